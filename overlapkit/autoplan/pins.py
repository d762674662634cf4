"""What a user pins of a layout, checked and spelled one way; and a layout written back as pins.

Everything the search varies can be pinned, on the command line and in ``ok.plan(auto=True)``:

========================  ====================================  ================================
what                      ``overlapkit plan --auto``            ``ok.plan(..., auto=True)``
========================  ====================================  ================================
parallel sizes            ``--tp --pp --dp --cp --ep``          ``tp= pp= dp= cp= ep=``
micro-batch size          ``--micro-batch``                     ``micro_batch=``
interleaving              ``--virtual-stages``                  ``virtual_stages=``
recomputation             ``--recompute none|selective|full``   ``recompute=``
  layers per stage        ``--recompute full:K|full:all``       ``recompute_layers=K|"all"``
sharding                  ``--sharding ddp|..|hsdp``            ``sharding=``
  hsdp shard group        ``--dp-shard N``                      ``dp_shard=``
========================  ====================================  ================================

``full`` alone leaves the number of recomputed layers to the search (as few per pipeline stage
as it takes to fit); ``full:K`` pins K layers of each stage, ``full:all`` every layer
(``TrainingLayout.recompute_layers`` None). ``ok.plan`` also takes ``recompute="full:K"``.

The search takes the pins as one ``fixed`` mapping (``check_pins`` normalises it: recompute
split into mode and layers, ``dp_shard`` implying hsdp). ``layout_pins`` turns a chosen layout
back into every pin, which ``plan_call`` and ``plan_command`` print as the ``ok.plan`` call and
the ``overlapkit plan --auto`` command that price exactly that layout.
"""

from __future__ import annotations

from collections.abc import Mapping

from overlapkit.planner.layout import RECOMPUTE, SHARDING, TrainingLayout

DIMS = ("tp", "pp", "dp", "cp", "ep")
PIN_KEYS = (
    *DIMS,
    "micro_batch",
    "virtual_stages",
    "recompute",
    "recompute_layers",
    "sharding",
    "dp_shard",
)
ALL_LAYERS = "all"
"""``recompute_layers`` pinned to every layer of each stage."""
RECOMPUTE_SPELLING = "none|selective|full|full:K|full:all"


def _count(key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"--{key.replace('_', '-')} must be an integer >= 1, got {value!r}")
    return value


def recompute_pins(recompute: object, recompute_layers: object = None) -> dict:
    """``{"recompute": mode[, "recompute_layers": K | "all"]}`` from either spelling.

    ``recompute`` is ``none``, ``selective``, ``full``, ``full:K`` or ``full:all``;
    ``recompute_layers`` K (an integer >= 1) or ``"all"``, with ``full`` only.

    Raises:
        ValueError: another mode, a K that is not an integer >= 1, layers without full, or
            layers given both ways, naming the value.
    """
    text = str(recompute)
    mode, colon, layers_text = text.partition(":")
    if not isinstance(recompute, str) or mode not in RECOMPUTE or (colon and mode != "full"):
        raise ValueError(f"--recompute {recompute!r}; valid: {RECOMPUTE_SPELLING}")
    layers: object = recompute_layers
    if colon:
        if recompute_layers is not None:
            raise ValueError(
                f"--recompute {text} already says the layers; recompute_layers="
                f"{recompute_layers!r} would say it again"
            )
        layers = layers_text if layers_text == ALL_LAYERS else _layer_count(text, layers_text)
    out: dict = {"recompute": mode}
    if layers is None:
        return out
    if mode != "full":
        raise ValueError(f"recompute_layers={layers!r} goes with recompute full, got {mode!r}")
    if layers != ALL_LAYERS:
        layers = _count("recompute_layers", layers)
    return out | {"recompute_layers": layers}


def _layer_count(text: str, layers_text: str) -> int:
    try:
        layers = int(layers_text)
    except ValueError:
        layers = 0
    if layers < 1:
        raise ValueError(
            f"--recompute {text}: K must be an integer >= 1 or 'all' "
            "(full:K recomputes K layers of each pipeline stage)"
        )
    return layers


def check_pins(fixed: Mapping[str, object]) -> dict:
    """``fixed`` checked and normalised for the search (see module doc); None values dropped.

    Raises:
        ValueError: an unknown key, a bad value, or pins that contradict each other (a
            ``dp_shard`` without hsdp), naming them.
    """
    out: dict = {}
    for key, value in fixed.items():
        if value is None or key in ("recompute", "recompute_layers"):
            continue
        if key not in PIN_KEYS:
            raise ValueError(f"cannot fix {key!r}; valid: {', '.join(PIN_KEYS)}")
        if key == "sharding":
            if value not in SHARDING:
                raise ValueError(f"--sharding {value!r}; valid: {', '.join(SHARDING)}")
            out[key] = value
        else:
            out[key] = _count(key, value)
    if fixed.get("recompute") is not None:
        out |= recompute_pins(fixed["recompute"], fixed.get("recompute_layers"))
    elif fixed.get("recompute_layers") is not None:
        raise ValueError(
            f"recompute_layers={fixed['recompute_layers']!r} goes with recompute full "
            "(--recompute full:K)"
        )
    if "dp_shard" in out and out.setdefault("sharding", "hsdp") != "hsdp":
        raise ValueError(
            f"--dp-shard {out['dp_shard']} goes with --sharding hsdp, got {out['sharding']!r}"
        )
    return out


def recompute_text(layout: TrainingLayout) -> str:
    """``none``, ``selective``, ``full:K`` or ``full:all`` (the ``--recompute`` spelling)."""
    if layout.recompute != "full":
        return layout.recompute
    layers = ALL_LAYERS if layout.recompute_layers is None else layout.recompute_layers
    return f"full:{layers}"


def layout_pins(layout: TrainingLayout) -> dict:
    """Every pin of ``layout``, as ``ok.plan`` keywords (``recompute_layers`` with full only,
    ``dp_shard`` with hsdp only)."""
    pins: dict = dict(layout.dims)
    pins |= {
        "micro_batch": layout.micro_batch,
        "virtual_stages": layout.virtual_stages,
        "recompute": layout.recompute,
    }
    if layout.recompute == "full":
        pins["recompute_layers"] = (
            ALL_LAYERS if layout.recompute_layers is None else layout.recompute_layers
        )
    pins["sharding"] = layout.sharding
    if layout.dp_shard is not None:
        pins["dp_shard"] = layout.dp_shard
    return pins


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
        *(f"{k}={v!r}" for k, v in layout_pins(layout).items()),
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
    pins = layout_pins(layout)
    pins["recompute"] = recompute_text(layout)
    pins.pop("recompute_layers", None)
    for key, value in (pins | dict(settings)).items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    return argv
