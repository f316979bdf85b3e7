"""SGLang backend tests; they run inside .venv-vllm (scripts/setup-vllm.sh installs the sglang wheel
without its CUDA dependencies) and are skipped by the main venv; tests/test_sglang_backend.py runs them.

Import shim: ``sglang.srt.configs`` imports every model's config at package import, and two
multimodal ones import torchvision, which has no build for the CPU torch used here. The
memory-pool modules under test need none of it, so those two modules are given empty
stand-ins (config classes with a ``model_type``) before sglang is imported. Everything
the tests exercise (HiCacheStorage, the backend factory, the MHA host pools) is SGLang's
real code.
"""

from __future__ import annotations

import importlib.util
import sys
import types

if importlib.util.find_spec("sglang") is None or importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["*.py"]
else:
    class _ConfigStandIns(types.ModuleType):
        def __getattr__(self, name: str) -> type:
            if name.startswith("__"):
                raise AttributeError(name)
            cls = type(name, (), {"model_type": f"unavailable-{name.lower()}"})
            setattr(self, name, cls)
            return cls

    if importlib.util.find_spec("torchvision") is None:
        internvl = _ConfigStandIns("sglang.srt.multimodal.internvl_utils")
        internvl.IMAGENET_MEAN, internvl.IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
        sys.modules[internvl.__name__] = internvl
        sys.modules["sglang.srt.configs.deepseek_ocr"] = _ConfigStandIns("sglang.srt.configs.deepseek_ocr")
