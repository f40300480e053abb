"""The loop that joins the layers below it: propose, verify in one pass, accept, roll back, repeat; and the one
driver that runs it over a stream of jobs."""

from .._lazy import submodules

__getattr__ = submodules(__name__)
