"""Import SGLang's storage and host-pool modules where its GPU stack is absent (this CPU machine).

``sglang.srt.configs`` imports every model's config at package import, and two multimodal ones
import torchvision, which has no build for the CPU torch used here.  The HiCache storage
interfaces, the backend factory, the host pools and the cache controller need none of it, so
those two modules get empty stand-ins (config classes with a ``model_type``) before sglang is
imported.  Everything else stays SGLang's real code; where torchvision is installed (a GPU
server) nothing is replaced.
"""

from __future__ import annotations

import importlib.util
import sys
import types


class _ConfigStandIns(types.ModuleType):
    def __getattr__(self, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        cls = type(name, (), {"model_type": f"unavailable-{name.lower()}"})
        setattr(self, name, cls)
        return cls


def allow_cpu_import() -> None:
    """Install the stand-ins (idempotent; a no-op where torchvision is importable)."""
    if importlib.util.find_spec("torchvision") is not None:
        return
    internvl = _ConfigStandIns("sglang.srt.multimodal.internvl_utils")
    internvl.IMAGENET_MEAN, internvl.IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    sys.modules.setdefault(internvl.__name__, internvl)
    sys.modules.setdefault("sglang.srt.configs.deepseek_ocr", _ConfigStandIns("sglang.srt.configs.deepseek_ocr"))
