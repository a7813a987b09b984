"""docs/schemas/ against the Python checks: over generated documents, the schema and the code
accept and reject the same ones.  The schemas cannot relate two values (``base < version``,
a list as long as ``task + 1``, ``eval.round`` against the header); those rules are listed in
each schema's ``$comment`` as the code's, and the generators keep to documents where they
hold, so every disagreement found here is a real one.  JSON Schema counts ``1.0`` as an
integer; the codec's JSON reader keeps it a float, and so does the validator here."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import referencing
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from aggregator.inbox import Inbox
from fclcore.capabilities import FIELDS, LAYOUTS, Decodes
from fclcore.codec import SPOKEN, VALUE_DTYPES, Frame, Header, Kind, decode
from fclcore.model_sync import ModelRef
from fclcore.transport import parse_status

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = {p.name: json.loads(p.read_text()) for p in (ROOT / "docs" / "schemas").glob("*.schema.json")}
NUM_TASKS, ROUND = 4, 9
_STRICT = jsonschema.Draft202012Validator.TYPE_CHECKER.redefine(
    "integer", lambda checker, value: isinstance(value, int) and not isinstance(value, bool)
)
Validator = jsonschema.validators.extend(jsonschema.Draft202012Validator, type_checker=_STRICT)
REGISTRY = referencing.Registry().with_resources(
    (s["$id"], referencing.Resource.from_contents(s)) for s in SCHEMAS.values()
)


def valid(name: str, document: object) -> bool:
    return Validator(SCHEMAS[name], registry=REGISTRY).is_valid(document)


def test_every_schema_is_a_valid_draft_2020_12_schema() -> None:
    assert len(SCHEMAS) >= 7
    for schema in SCHEMAS.values():
        jsonschema.Draft202012Validator.check_schema(schema)


def test_the_golden_vectors_meta_is_valid() -> None:
    """Every frame of docs/protocol-vectors/ has metadata its kind's schema accepts."""
    by_kind = {"ROUND": "round", "FINISH": "round", "REQUEST": "request", "UPDATE": "update", "EVAL": "eval"}
    checked = set()
    for vector in json.loads((ROOT / "docs" / "protocol-vectors" / "frames.json").read_text()):
        meta, kind = vector["decoded"]["meta"], vector["decoded"]["header"]["kind"]
        if kind in by_kind:
            assert valid(f"{by_kind[kind]}-meta.schema.json", meta), vector["name"]
            checked.add(kind)
        if "model" in meta:
            assert valid("model-ref.schema.json", meta["model"]), vector["name"]
    assert checked == set(by_kind)


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**53), 2**53),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
)
anything = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)


@settings(max_examples=200, deadline=None)
@given(st.one_of(anything, st.dictionaries(st.sampled_from(["state", "time", "run", "round"]), anything)))
def test_status_schema_and_parse_status_agree(document) -> None:
    """P-10.1."""
    assert valid("status.schema.json", document) == (parse_status(json.dumps(document).encode()) is not None)


counts = st.one_of(st.integers(-3, 2**32 + 3), anything)


@settings(max_examples=200, deadline=None)
@given(
    st.one_of(
        anything,
        st.fixed_dictionaries(
            {"version": counts},
            optional={
                "base": counts,
                "hash": st.one_of(st.text(min_size=31, max_size=33), anything),
                "digest": st.one_of(st.sampled_from(["a" * 64, "A" * 64, "0" * 63, "f" * 64]), anything),
                "derived": st.one_of(st.lists(st.text(max_size=3), max_size=2), anything),
                "removed": st.one_of(st.lists(st.text(max_size=3), max_size=2), anything),
            },
        ),
    )
)
def test_model_ref_schema_and_code_agree(document) -> None:
    """P-7.1, P-7.4 (``base < version`` is the code's alone: such documents are not generated)."""
    if isinstance(document, dict) and all(
        isinstance(document.get(k), int) and not isinstance(document.get(k), bool) for k in ("version", "base")
    ):
        assume(document["base"] < document["version"])
    try:
        ModelRef.of({"model": document})
        accepted = document is not None
    except ValueError:
        accepted = False
    assert valid("model-ref.schema.json", document) == accepted


def _report(draw_task, metric: str, entries: list, broken: object) -> dict:
    """An evaluation report whose code-only rules hold (list length, entry ``task``, round)."""
    report = {"round": ROUND - 1, "task": draw_task, metric: entries}
    if broken is not None:
        report[broken[0]] = broken[1]
    return report


@st.composite
def eval_reports(draw) -> object:
    if draw(st.integers(0, 9)) == 0:
        return draw(anything)
    task = draw(st.integers(0, NUM_TASKS - 1))
    metric = draw(st.sampled_from(["nll", "accuracy"]))
    number = st.floats(0, 1) if metric == "accuracy" else st.floats(-1e6, 1e6)
    entries = draw(st.lists(st.one_of(st.none(), number), min_size=task, max_size=task)) + [draw(number)]
    broken = draw(
        st.one_of(
            st.none(),
            st.tuples(st.sampled_from(["round", "task"]), anything),
            st.tuples(st.just("accuracy" if metric == "nll" else "nll"), anything),  # both metrics
            st.tuples(st.just(metric), anything.filter(lambda v: not isinstance(v, list))),  # (a length: code)
            st.just((metric, entries[:-1] + [2.5 if metric == "accuracy" else "x"])),
            st.just(("task", -1)),
        )
    )
    report = _report(task, metric, entries, broken)
    other = report.get("task")
    if isinstance(other, int) and not isinstance(other, bool) and other >= 0:
        assume(other == task)  # another task: its list length (and task < num_tasks) would be the code's rules
    if isinstance(report.get("round"), int) and not isinstance(report["round"], bool):
        assume(report["round"] == ROUND - 1)
    return report


def _code_accepts(meta: dict, kind: Kind) -> bool:
    inbox = Inbox("f", {"c"}, lambda frame: {}, NUM_TASKS)
    return inbox._content_problem(Frame(Header(kind, "f", ROUND, 0, "c", 1), meta, {}), kind) is None


@settings(max_examples=200, deadline=None)
@given(
    st.fixed_dictionaries(
        {},
        optional={
            "n_samples": st.one_of(st.integers(-2, 2**31 + 2), anything),
            "eval": eval_reports(),
            "train_nll": anything,
            "rejected": anything,
        },
    )
)
def test_update_and_eval_schemas_and_the_inbox_agree(meta: dict) -> None:
    """P-8.3, P-8.4, P-8.5."""
    assert valid("update-meta.schema.json", meta) == _code_accepts(meta, Kind.UPDATE)
    assert valid("eval-meta.schema.json", meta) == _code_accepts(meta, Kind.EVAL)


def test_what_the_devices_send_is_valid() -> None:
    """A Python device's update metadata as committed in a vector, and the C device's shape."""
    (update,) = [
        decode(bytes.fromhex(v["hex"])).meta
        for v in json.loads((ROOT / "docs" / "protocol-vectors" / "frames.json").read_text())
        if v["name"] == "update-index-u16"
    ]
    assert valid("update-meta.schema.json", update)
    assert valid("update-meta.schema.json", {"n_samples": 40, "train_nll": None, "rejected": {}})
    assert not valid("update-meta.schema.json", {"n_samples": 40.0})


def test_the_decodes_schema_lists_what_the_code_speaks() -> None:
    """P-VER-5: the schema's enums are the code's frame versions, dtypes and layouts."""
    props = SCHEMAS["decodes.schema.json"]["properties"]
    assert props["frames"]["items"]["enum"] == list(SPOKEN)
    assert props["dtypes"]["items"]["enum"] == list(VALUE_DTYPES)
    assert props["layouts"]["items"]["enum"] == list(LAYOUTS)
    assert sorted(props) == sorted(FIELDS)


def _decodes_ok(document) -> bool:
    try:
        Decodes.of(document)
    except ValueError:
        return False
    return True


field_values = st.one_of(
    anything,
    st.lists(st.sampled_from([*SPOKEN, 3, 1.0, True, *VALUE_DTYPES, "bfloat16", *LAYOUTS, "csr"]), max_size=4),
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from([*FIELDS, "sparse"]), field_values, max_size=4))
def test_decodes_schema_and_decodes_of_agree(document) -> None:
    """P-CAP-1: a status's decodes the schema accepts is one the aggregator reads, and no other."""
    assert valid("decodes.schema.json", document) == _decodes_ok(document)
