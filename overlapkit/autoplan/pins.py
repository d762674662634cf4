"""What a user pins of a layout, spelled one way; and a layout written back as pins.

Everything the search varies can be pinned, on the command line and in ``ok.plan(auto=True)``,
as one ``PartialLayout`` (``overlapkit.layout``); see docs/auto-planner.md ("Pinning") for the
table of spellings. ``--recompute full`` alone leaves the number of recomputed layers to the
search, ``full:K`` pins K layers of each pipeline stage (of each model chunk with interleaving),
``full:all`` every layer.
"""

from __future__ import annotations

from collections.abc import Mapping

from overlapkit.layout import ALL_LAYERS, RECOMPUTE, PartialLayout, TrainingLayout
from overlapkit.layout.training_layout import Spelling, as_named

RECOMPUTE_SPELLING = "none|selective|full|full:K|full:all"


def cli_flag(key: str) -> str:
    """``overlapkit plan --auto``'s flag for a choice: ``--dp-shard``."""
    return f"--{key.replace('_', '-')}"


def pins_from(values: Mapping[str, object], *, spell: Spelling = as_named) -> PartialLayout:
    """The pins in ``values`` (None: free): ``ok.plan`` keywords, CLI flags' values,
    ``parallel.pins``; ``recompute`` may say the layers too (``full:K``, ``full:all``), and a
    ``dp_shard`` without a sharding pins hsdp.

    Raises:
        TypeError / ValueError: an unknown key, a bad value, pins that contradict each other
            (layers given twice, ``dp_shard`` without hsdp), spelled by ``spell``.
    """
    given = {key: value for key, value in values.items() if value is not None}
    if "recompute" in given:
        given |= recompute_pins(given["recompute"], given.get("recompute_layers"), spell)
    if "dp_shard" in given:
        given.setdefault("sharding", "hsdp")
    return PartialLayout.from_mapping(given, spell=spell)


def recompute_pins(
    recompute: object, recompute_layers: object = None, spell: Spelling = cli_flag
) -> dict:
    """``{"recompute": mode, "recompute_layers": K | "all" | None}`` from either spelling.

    Raises:
        ValueError: another mode, a K that is not an integer >= 1 or ``all``, or the layers
            given both ways, naming the value.
    """
    text = str(recompute)
    mode, colon, layers_text = text.partition(":")
    if not isinstance(recompute, str) or mode not in RECOMPUTE or (colon and mode != "full"):
        raise ValueError(f"{spell('recompute')} {recompute!r}; valid: {RECOMPUTE_SPELLING}")
    if not colon:
        return {"recompute": mode, "recompute_layers": recompute_layers}
    if recompute_layers is not None:
        raise ValueError(
            f"{spell('recompute')} {text} already says the layers; "
            f"{spell('recompute_layers')}={recompute_layers!r} would say it again"
        )
    if layers_text != ALL_LAYERS and not (layers_text.isdigit() and int(layers_text) >= 1):
        raise ValueError(
            f"{spell('recompute')} {text}: K must be an integer >= 1 or 'all' "
            "(full:K recomputes K layers of each pipeline stage)"
        )
    layers = layers_text if layers_text == ALL_LAYERS else int(layers_text)
    return {"recompute": mode, "recompute_layers": layers}


def recompute_text(layout: TrainingLayout) -> str:
    """``none``, ``selective``, ``full:K`` or ``full:all`` (the ``--recompute`` spelling)."""
    if layout.recompute != "full":
        return layout.recompute
    layers = ALL_LAYERS if layout.recompute_layers is None else layout.recompute_layers
    return f"full:{layers}"


def pins_text(pins: PartialLayout) -> str:
    """The pins as flags (``--tp 2 --recompute full:3``), or ``none fixed``."""
    given = pins.given()
    if "recompute" in given:
        layers = given.pop("recompute_layers", None)
        given["recompute"] += "" if layers is None else f":{layers}"
    return " ".join(f"{cli_flag(k)} {v}" for k, v in given.items()) or "none fixed"


def plan_call(
    layout: TrainingLayout,
    *,
    topology: str,
    fabric: str | None,
    model: str | None,
    global_batch: int,
    seq_len: int,
    settings: Mapping[str, object],
) -> str:
    """The ``ok.plan(..., auto=True)`` call that prices exactly ``layout``: valid Python.

    ``model`` is what ``load_model`` reads (a name, a config.json path, a ``gpt:`` shape); None
    (a ``ModelSpec`` passed from Python) prints the name ``model``, the caller's variable.
    ``settings``: the search's settings as ``ok.plan`` keywords (``attention``, ...).
    """
    topo = repr(topology) + ("" if fabric is None else f", fabric={fabric!r}")
    words = [
        f"model={'model' if model is None else repr(model)}",
        f"global_batch={global_batch}",
        f"seq_len={seq_len}",
        *(f"{k}={v!r}" for k, v in PartialLayout.of(layout).given().items()),
        *(f"{k}={v!r}" for k, v in settings.items()),
        "auto=True",
    ]
    return f"ok.plan(ok.load_topology({topo}), {', '.join(words)})"


def plan_command(
    layout: TrainingLayout,
    *,
    topology: str,
    fabric: str | None,
    model: str,
    global_batch: int,
    seq_len: int,
    settings: Mapping[str, object],
) -> list[str]:
    """The ``overlapkit plan --auto`` command (argv) that prices exactly ``layout``."""
    argv = ["overlapkit", "plan", "--auto", "--topology", topology]
    if fabric is not None:
        argv += ["--fabric", fabric]
    argv += ["--model", model, "--global-batch", str(global_batch), "--seq-len", str(seq_len)]
    pins = PartialLayout.of(layout).given()
    pins["recompute"] = recompute_text(layout)
    pins.pop("recompute_layers", None)
    for key, value in (pins | dict(settings)).items():
        argv += [cli_flag(key), str(value)]
    return argv
