"""Where the pipeline's stages cut the layers: at equal cost, the last stage's head counted.

An even split by layer count leaves the last stage with the final norm, the LM head and the sampler on top of its
layers: SmolLM2's tied 49,152 x 576 head costs ~5 of its layers at batch 64, so with 15 + 15 layers the first stage
idled 28-60 % of every step (benchmarks/results/pp.md). The cut that balances the stages depends on the machine (a
head is one wide GEMM, a layer many small ops: their ratio moved from 4.4 to 6.5 layers between batch 1 and 64),
so it is measured (pp_probe.py) rather than counted in weights.

`pp_layer_partition` (EngineConfig) picks how:
  "auto"   rank 0 measures a step of one layer of each kind and of the head at the PP loop's micro-batch size
           (pp_probe.py), and every stage takes its share of the cut that balances those costs;
  "even"   as many layers a stage as can be (30 over 4: 8, 8, 7, 7);
  "19,11"  the layers of each stage, in order (as vLLM's VLLM_PP_LAYER_PARTITION).
Rank 0 decides and broadcasts (PPGroup), so every stage holds the same cut whatever it would measure itself. The cut
changes no arithmetic: a row's bits are the same with any split (tests/parallel/test_pp.py).
"""
from __future__ import annotations

import logging
from typing import Sequence

log = logging.getLogger(__name__)

MODES = ("auto", "even")
PROBE_ROWS = 32             # the probe's decode rows at most (micro_batch)


def even_sizes(num_layers: int, pp_size: int) -> list[int]:
    """As even as possible, the first stages one longer where they do not split evenly."""
    base, extra = divmod(num_layers, pp_size)
    return [base + (1 if s < extra else 0) for s in range(pp_size)]


def ranges(sizes: Sequence[int]) -> list[range]:
    """Each stage's layers from the layers a stage."""
    out, start = [], 0
    for n in sizes:
        out.append(range(start, start + n))
        start += n
    return out


def check_partition_text(text: str, pp_size: int) -> list[int] | None:
    """The layers a stage that `text` names (None for "auto" / "even"), or a ValueError that says what is
    wrong; the layer count is checked once the model is known (check_sizes)."""
    if text in MODES:
        return None
    try:
        sizes = [int(p) for p in text.split(",")]
    except ValueError:
        raise ValueError(f"pp_layer_partition must be 'auto', 'even' or the layers of each stage as comma-separated "
                         f"integers (e.g. '19,11'), got {text!r}") from None
    if len(sizes) != pp_size:
        raise ValueError(f"pp_layer_partition {text!r} names {len(sizes)} stages, but pp_size is {pp_size}")
    if min(sizes) < 1:
        raise ValueError(f"pp_layer_partition {text!r}: every pipeline stage needs at least one layer")
    return sizes


def check_sizes(sizes: Sequence[int], num_layers: int, name: str = "the model") -> None:
    if sum(sizes) != num_layers:
        raise ValueError(f"pp_layer_partition {','.join(map(str, sizes))} sums to {sum(sizes)} layers, but "
                         f"{name} has {num_layers}")


def balanced_sizes(layer_costs: Sequence[float], pp_size: int, first_extra: float = 0.0,
                   last_extra: float = 0.0) -> list[int]:
    """The contiguous cut of the layers into pp_size stages (each at least one layer) whose costliest stage costs
    the least: layer_costs[i] for layer i, first_extra on the first stage (the embedding), last_extra on the
    last (final norm, LM head, sampler). Ties go to the cut with the earlier stages longer (as even_sizes)."""
    n = len(layer_costs)
    if not 1 <= pp_size <= n:
        raise ValueError(f"{pp_size} stages do not fit {n} layers")
    prefix = [0.0]
    for c in layer_costs:
        prefix.append(prefix[-1] + c)

    def cost(a: int, b: int, s: int) -> float:       # stage s holding layers [a, b)
        return prefix[b] - prefix[a] + (first_extra if s == 0 else 0.0) + (last_extra if s == pp_size - 1 else 0.0)

    # best[s][i]: the least max cost of stages s.. holding layers [i, n); taken[s][i]: stage s's layer count there
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(pp_size + 1)]
    taken = [[0] * (n + 1) for _ in range(pp_size)]
    best[pp_size][n] = 0.0
    for s in range(pp_size - 1, -1, -1):
        left = pp_size - 1 - s                          # stages after s, a layer each at least
        for i in range(s, n - left):
            for j in range(n - left, i, -1):            # longest first: ties keep the earlier stage longer
                v = max(cost(i, j, s), best[s + 1][j])
                if v < best[s][i] * (1 - 1e-9):
                    best[s][i], taken[s][i] = v, j - i
    sizes, i = [], 0
    for s in range(pp_size):
        sizes.append(taken[s][i])
        i += taken[s][i]
    return sizes


def micro_batch(max_running: int, pp_size: int) -> int:
    """The rows of a decode micro-batch at full load (the PP loop picks at most 1 / pp_size of the decoding
    requests a micro-batch: scheduler/pick.py), capped at PROBE_ROWS so the probe stays short."""
    return max(1, min(PROBE_ROWS, -(-max_running // pp_size)))


def decide(spec, device) -> tuple[list[int], str]:
    """Rank 0's cut (the layers of each stage) and a line that says how it was chosen (the module docstring)."""
    num_layers, pp_size = spec.source.config.num_layers, spec.pp_size
    sizes = check_partition_text(spec.pp_layer_partition, pp_size)
    if sizes is not None:
        check_sizes(sizes, num_layers)
        return sizes, "as pp_layer_partition gives"
    if spec.pp_layer_partition == "even":
        return even_sizes(num_layers, pp_size), "even (pp_layer_partition 'even')"
    from .pp_probe import measure
    try:
        costs = measure(spec, device, micro_batch(spec.max_running, pp_size))
    except Exception as e:       # a probe that fails costs the balance only: say so, and split evenly
        log.warning("pipeline stages split evenly: measuring the layers' cost failed (%s: %s)", type(e).__name__, e)
        return even_sizes(num_layers, pp_size), f"even (the probe failed: {type(e).__name__})"
    sizes = balanced_sizes(costs.layers, pp_size, costs.embed, costs.head)
    ms = sorted(costs.layers)[len(costs.layers) // 2] * 1e3
    return sizes, (f"balanced by measured decode cost at {costs.batch} rows: a layer ~{ms:.2f} ms, the head "
                   f"{costs.head * 1e3:.2f} ms, the embedding {costs.embed * 1e3:.2f} ms")
