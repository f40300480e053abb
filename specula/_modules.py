"""How specula's modules are reached: as attributes of their packages, imported on first use
(``specula.hf.loading.load_model()`` after ``import specula``), and under their names from before they moved into
packages (0.2): ``import specula.models`` and ``from specula.loop import Decoder`` give the module at its new place."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

RENAMED = {  # old module (under specula) -> its new place
    "acceptance": "core.acceptance", "answers": "jobs.answers", "batch_size": "policy.batch_size",
    "bench": "tools.bench", "cached_model": "target.runner", "calibration": "target.calibration",
    "cpu_layout": "target.cpu_layout", "draft_length": "policy.adaptive", "drift": "tools.drift",
    "inputs": "hf.inputs", "invariance": "tools.probe", "kernels": "proposers.kernels", "loop": "core.loop",
    "models": "hf.loading", "ngram": "proposers.ngram", "precision": "hf.precision", "prompt_lookup":
    "proposers.prompt_lookup", "proposer": "proposers.base", "ray_job": "jobs.ray", "row_exact": "target.row_exact",
    "sampling": "core.sampling", "small_model": "proposers.small_model", "stats": "core.stats",
    "workloads": "jobs.requests",
}
# Old modules whose names are packages now: their names, forwarded by the package's ``__getattr__``.
FORWARDED = {
    "hf": ("generate", ("SpeculaGenerateOutput", "custom_generate", "prepare_jobs")),
    "proposers": ("registry", ("ENTRY_POINT_GROUP", "PROPOSER_NAMES", "available", "check_proposer",
                               "proposer_factory")),
}


def attribute(package: str, name: str):
    """``package.name`` for the ``__getattr__`` of specula's packages: a module of the package, a module's name from
    before 0.2, or a name the old module that ``package`` replaces had."""
    short = package.partition(".")[2]
    if importlib.util.find_spec(f"{package}.{name}") is not None:
        return importlib.import_module(f"{package}.{name}")
    if short in FORWARDED and name in FORWARDED[short][1]:
        return getattr(importlib.import_module(f"{package}.{FORWARDED[short][0]}"), name)
    raise AttributeError(f"module {package!r} has no attribute {name!r}")


class _OldNames(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports ``specula.<old>`` as the module at its new place (one module object under both names)."""

    def find_spec(self, fullname, path, target=None):
        package, _, old = fullname.partition(".")
        if package == "specula" and old in RENAMED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        module = importlib.import_module(f"specula.{RENAMED[spec.name.partition('.')[2]]}")
        spec.loader_state = module.__spec__  # the import system puts the old name's spec on the module: undone below
        return module

    def exec_module(self, module) -> None:
        module.__spec__ = module.__spec__.loader_state


def install() -> None:
    if not any(isinstance(finder, _OldNames) for finder in sys.meta_path):
        sys.meta_path.append(_OldNames())
