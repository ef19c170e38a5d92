"""Lets PyPI's torchvision import over the CPU build of torch (benchmarks/engines_check.sh
installs it into its venv with a .pth line, so every process there has it).

PyPI's Linux torchvision is built against the CUDA torch: over torch+cpu its _C.so does not
load, and `import torchvision` then fails ("operator torchvision::nms does not exist") when
it registers fake kernels for ops nobody defined. vLLM imports torchvision whenever it is
installed (its model-inspection subprocess too), and SGLang imports torchvision.transforms
while it resolves a model's config. At the first `import torchvision`, this loads _C if it
can, and otherwise declares the two ops' schemas, so the import succeeds; the ops stay
without kernels (configuration code never calls them).
"""
import importlib.abc
import importlib.util
import os
import sys


class TorchvisionOnCpu(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "torchvision":
            return None
        sys.meta_path.remove(self)  # once; and not while the real finders look
        spec = importlib.util.find_spec("torchvision")
        if spec is None or not spec.submodule_search_locations:
            return None
        import torch
        try:
            torch.ops.load_library(os.path.join(list(spec.submodule_search_locations)[0],
                                                "_C.so"))
        except (OSError, RuntimeError):
            schemas = torch.library.Library("torchvision", "FRAGMENT")
            for op in ("nms", "qnms"):
                schemas.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            TorchvisionOnCpu.schemas = schemas  # kept alive: the definitions live with it
        return None  # the ordinary finders import it


if not any(isinstance(f, TorchvisionOnCpu) for f in sys.meta_path):
    sys.meta_path.insert(0, TorchvisionOnCpu())
