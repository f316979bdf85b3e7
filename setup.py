"""The build's one step beyond pyproject.toml: the native modules, kept here because setuptools'
pyproject form of ext-modules is still experimental.  Both are optional: without a C compiler (or,
for kvswarm.io._batchio, without Linux's io_uring header) the install goes on and the store takes its
Python paths (kvswarm.store.verify.verify_submit is None, the vLLM tier logs it;
kvswarm.io.native.available() is False).

* kvswarm.store._verify (native/verify.c): the verify-and-copy worker threads.
* kvswarm._digest_index (native/digest_index.c): the catalog's digest -> row table, a batch of keys
  hashed and looked up in one call.
* kvswarm.io._batchio (native/batchio.c): whole batches of O_DIRECT I/O on io_uring, reads verified
  and scattered in native code (see docs/native-io.md).
xxHash's own header is vendored beside them; native/payload.h is what both share."""

from setuptools import Extension, setup

NATIVE = "src/kvswarm/native"
DEPENDS = [f"{NATIVE}/xxhash.h", f"{NATIVE}/payload.h"]

setup(ext_modules=[
    Extension("kvswarm.store._verify", sources=[f"{NATIVE}/verify.c"], include_dirs=[NATIVE], depends=DEPENDS,
              extra_compile_args=["-O3"], optional=True),
    Extension("kvswarm._digest_index", sources=[f"{NATIVE}/digest_index.c"], include_dirs=[NATIVE],
              depends=[f"{NATIVE}/xxhash.h"], extra_compile_args=["-O3"], optional=True),
    Extension("kvswarm.io._batchio", sources=[f"{NATIVE}/batchio.c"], include_dirs=[NATIVE], depends=DEPENDS,
              extra_compile_args=["-O3"], optional=True),
])
