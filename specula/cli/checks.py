"""What the ``specula`` command checks before any model work, in the order it checks it: options that do not go
together, files to read and write, proposers, the model's path, the device. Each problem is one line on stderr and
exit status 2, as argparse's own usage errors; torch is imported only to check a ``--device``, last."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
from pathlib import Path
from typing import NoReturn

from ..hf.registry import check_proposer
from ..jobs.answer_file import AnswerFile
from ..jobs.requests import BadRequest, Shape, file_shape, load_workloads, model_name, unique_requests


def check(args: argparse.Namespace) -> None:
    """Stop at the first problem of a parsed command line, as a usage error: one line, nothing loaded or written."""
    for find in (
        _generate_problem,
        _input_problem,
        _output_problem,
        _proposer_problem,
        _model_problem,
        _adapter_problem,
        _ray_problem,
        _serve_problem,
        _device_problem,
    ):
        problem = find(args)
        if problem is not None:
            usage_error(args, problem)


def usage_error(args: argparse.Namespace, problem: str) -> NoReturn:
    print(f"specula {args.command}: error: {problem}", file=sys.stderr)
    raise SystemExit(2)


def read_files(args: argparse.Namespace) -> None:
    """Read what the command needs from its files before anything heavy is imported, onto ``args``: the answers
    already in ``--output`` (``args.answers``; ``--resume``: a file that is not answers is a usage error) and every
    workload line of ``bench`` (``args.workload_rows``), and whether --input is an OpenAI Batch API file
    (``args.batch_api``)."""
    if args.command == "generate":
        try:
            args.answers = AnswerFile(args.output, resume=args.resume) if args.input else None
        except ValueError as error:
            usage_error(args, str(error))
        names = (model_name(args.model), *(args.adapter or ()))  # (what a request's "model" may name)
        args.batch_api = _check_requests(args.input, args.strict, names) if args.input else None
    if args.command == "bench":
        try:
            args.workload_rows = load_workloads(args.workloads, args.limit)
        except BadRequest as error:
            raise SystemExit(f"error: {error}; fix or remove that line") from None


def _check_requests(path: Path, strict: bool, model: tuple[str, ...]) -> bool:
    """Every line of a requests file read before the model loads: an error (one line, status 1) where the file mixes
    specula's request lines with OpenAI Batch API lines, where no line is a request, or, with ``strict``, at the
    first bad line (what the tokenizer must judge, such as a prompt longer than the model's context, is checked once
    it is loaded, still before any decoding). ``model``: the names requests may give the model and its adapters.
    Returns whether it is a Batch API file."""
    try:
        batch_api = file_shape(path) is Shape.BATCH_API
    except ValueError as error:
        raise SystemExit(f"error: --input {error}") from None
    lines = bad = 0
    first = None
    for _, request in unique_requests(path, model):
        lines += 1
        if isinstance(request, BadRequest):
            if strict:
                raise SystemExit(f"error: {request} (--strict)")
            bad, first = bad + 1, first or request
    if not lines:
        raise SystemExit(f"error: --input {path} holds no requests (every line is empty)")
    if bad == lines:
        raise SystemExit(f"error: no line of --input {path} is a request ({bad} bad lines; the first: {first})")
    return batch_api


def _generate_problem(args: argparse.Namespace) -> str | None:
    """generate's options that do not go together, or need what is not installed."""
    if args.command != "generate":
        return None
    if (args.prompt is None) == (args.input is None):
        return "give either --prompt TEXT or --input FILE (with --output FILE)"
    if args.input is not None and args.output is None:
        return "--input needs --output FILE"
    if args.resume and args.overwrite:
        return "--resume keeps the answers in --output, --overwrite replaces them: give one of them"
    if args.prompt is not None and (args.resume or args.ray or args.json):
        flag = "--resume" if args.resume else "--ray" if args.ray else "--json"
        return f"{flag} works on files: give --input FILE and --output FILE"
    return None


def _ray_problem(args: argparse.Namespace) -> str | None:
    if not getattr(args, "ray", False):
        return None
    try:
        import ray  # noqa: F401  (slow to import: checked after the files)
        import ray.data  # noqa: F401
    except ImportError:
        return '--ray needs Ray Data, an optional extra: pip install "specula[ray]"'
    return None


def _input_problem(args: argparse.Namespace) -> str | None:
    """The first problem with the files and folders a command reads."""
    source = getattr(args, "input", None)
    if source is not None:
        if not source.is_file():
            return f"--input {source}: {'not a file' if source.exists() else 'no such file'}"
        if not os.access(source, os.R_OK):
            return f"--input {source}: not readable (check its permissions)"
    text = getattr(args, "text", None)
    if text is not None and not Path(text).is_file():
        return f"--text {text}: no such file"
    workloads = getattr(args, "workloads", None)
    if workloads is not None and not workloads.is_file():
        if not workloads.is_dir():
            return f"--workloads {workloads}: no such folder or file"
        if not any(workloads.glob("*.jsonl")):
            return f"--workloads {workloads}: no *.jsonl workloads in it"
    return None


def _output_problem(args: argparse.Namespace) -> str | None:
    """The first problem with the files a command writes (each tried, and left as it was)."""
    source = getattr(args, "input", None)
    for flag in ("output", "json"):
        path = getattr(args, flag, None)
        if path is None:
            continue
        if not path.parent.is_dir():
            return f"--{flag} {path}: the folder {path.parent} does not exist; create it first (mkdir -p {path.parent})"
        if path.is_dir():
            return f"--{flag} {path}: is a folder; give a file name"
        if source is not None and path.resolve() == source.resolve():
            return f"--{flag} {path} is the input file; write the answers elsewhere"
        if flag == "output" and path.exists() and path.stat().st_size and not (args.overwrite or args.resume):
            return (
                f"--output {path} already holds answers; pass --resume to answer only the requests it lacks, "
                "--overwrite to replace them, or choose another file"
            )
        try:  # can it be written (permissions, read-only file systems)? (a file not there yet: one beside it, unnamed,
            # so that nothing watching the path sees a file come and go)
            with path.open("a") if path.exists() else tempfile.TemporaryFile(dir=path.parent):
                pass
        except OSError as error:
            return f"--{flag} {path}: cannot be written ({error.strerror})"
    return None


def _proposer_problem(args: argparse.Namespace) -> str | None:
    """An unknown, malformed or broken proposer (a draft model: a path that is no model)."""
    flag = "--proposers" if hasattr(args, "proposers") else "--proposer"
    if not hasattr(args, flag[2:]):
        return None
    for spec in getattr(args, flag[2:]).split(","):
        name, _, path = spec.partition(":")
        if name == "draft":
            problem = _model_path_problem(path) if path else "give the draft model's path: draft:PATH"
            if problem is not None:
                return f"{flag} {spec}: {problem}"
            continue
        try:
            check_proposer(spec)
        except ValueError as error:
            return f"{flag} {spec}: {error}"
    return None


def _model_problem(args: argparse.Namespace) -> str | None:
    model = getattr(args, "model", None)
    if model is None or (getattr(args, "ray", False) and os.environ.get("RAY_ADDRESS")):
        return None  # the default model (its package is checked as it loads), or a path on the cluster's nodes
    problem = _model_path_problem(model)
    return None if problem is None else f"--model {model}: {problem}"


def _adapter_problem(args: argparse.Namespace) -> str | None:
    """``--adapter [NAME=]DIR`` options made ``args.adapter``, the folders by name (in their order; a folder alone
    goes by its name): a name given twice, or one that is the model's own, is a problem."""
    given = getattr(args, "adapter", None)
    if not given:
        return None
    folders: dict[str, str] = {}
    for value in given:
        name, _, folder = value.rpartition("=") if "=" in value else (Path(value).name, "", value)
        if not name or not folder:
            return f"--adapter {value}: give a folder, or NAME=FOLDER"
        if name in folders or name == model_name(args.model):
            return f"--adapter {value}: the name {name!r} is taken (the model's or another adapter's); use NAME=FOLDER"
        folders[name] = folder
    args.adapter = folders
    return None


def _model_path_problem(text: str) -> str | None:
    """Why ``text`` names no model :func:`load_model` can load (the rule of :func:`resolve_model`, which converts a
    GGUF file: too slow for a check)."""
    path = Path(text).expanduser()
    if (path.is_file() and path.suffix == ".gguf") or (path.is_dir() and (path / "config.json").is_file()):
        return None
    if not path.exists():
        return "no such file or folder"
    return "neither an HF model folder (with config.json) nor a .gguf file"


def _serve_problem(args: argparse.Namespace) -> str | None:
    """``serve`` without its extra installed."""
    if args.command != "serve":
        return None
    missing = [name for name in ("fastapi", "uvicorn") if importlib.util.find_spec(name) is None]
    return f"needs {' and '.join(missing)}: pip install 'specula[serve]'" if missing else None


def _device_problem(args: argparse.Namespace) -> str | None:
    device = getattr(args, "device", None)
    if device is None:
        return None
    import torch  # (the one check that needs it, made last)

    try:
        wanted = torch.device(device)
    except RuntimeError:
        return f"--device {device}: not a torch device (e.g. cpu, cuda, cuda:1)"
    if getattr(args, "ray", False):  # (Ray workers decode on what --gpus-per-worker says)
        return None
    if wanted.type == "cuda" and (wanted.index or 0) >= torch.cuda.device_count():
        return f"--device {device}: no such CUDA device here ({torch.cuda.device_count()} found)"
    return None
