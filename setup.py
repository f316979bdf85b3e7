"""The build's one step beyond pyproject.toml: the native verify worker (src/kvswarm/native/verify.c,
with xxHash's own header vendored beside it), kept here because setuptools' pyproject form of
ext-modules is still experimental.  Optional: without a C compiler the install goes on and the store
verifies in Python (kvswarm.store.verify.verify_submit is None; the vLLM tier logs it)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "kvswarm.store._verify",
    sources=["src/kvswarm/native/verify.c"],
    include_dirs=["src/kvswarm/native"],
    depends=["src/kvswarm/native/xxhash.h"],
    extra_compile_args=["-O3"],
    optional=True,
)])
