"""Communication model of a tensor- and pipeline-parallel step: bytes per collective and their time over a link.

Cost of one message of n bytes among p ranks over a link of bandwidth BW (bytes/s per direction per rank) and
latency α (seconds per message hop), the α-β model of Thakur, Rabenseifner and Gropp 2005 ("Optimization of
collective communication operations in MPICH", IJHPCA 19(1)):

  all-reduce (ring: reduce-scatter then all-gather)  t = 2·(p-1)/p · n / BW + 2·(p-1)·α      n = the reduced tensor
  all-gather (ring)                                  t = (p-1)/p · n / BW + (p-1)·α          n = the gathered output
  point-to-point send                                t = n / BW + α
  all-to-all (pairwise exchange)                     t = (p-1)/p · n / BW + (p-1)·α          n = a rank's send buffer

The ring all-reduce's 2·(p-1)/p · n bytes per rank is the least any all-reduce can send (Patarasuk and Yuan 2009,
"Bandwidth optimal all-reduce algorithms for clusters of workstations", JPDC 69(2)).

What a step of loom's tensor-parallel model sends (loom/distributed/tensor_parallel.py, loom/model/llama.py), T
tokens of hidden size d in activations of a bytes each, N tensor-parallel ranks:

  per decoder layer  2 all-reduces of T·d·a bytes (after o_proj and after down_proj)
  per step           1 all-reduce of T·d·a (the vocab-parallel embedding's rows)
                     1 all-gather of R·N·⌈V/N⌉·a (the sampled rows' logits; each rank pads its part to the
                       widest)
  pipeline stages    2 sends of T·d·a (hidden state and residual) at each of the M-1 stage boundaries

Decode has T = R = B (the batch); a prefill of one prompt has T = N_prompt and R = 1. Not counted: rank 0's
per-step StepMessage broadcast to the workers (loom/executor/multiproc.py; a few hundred bytes of diff, a couple
of latencies per step) and the sampled tokens' return.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from loom.bench.model_arch import ModelArch
from loom.bench.roofline import Roofline

OPS = ("all_reduce", "all_gather", "send", "all_to_all")


@dataclass(frozen=True, slots=True)
class OpLink:
    """Measured constants of one operation, replacing the link's own for that operation (a per-op fit)."""

    op: str  # one of OPS
    bandwidth: float  # BW of the op's formula, bytes/s
    latency: float  # α of the op's formula, seconds per message hop


@dataclass(frozen=True, slots=True)
class Interconnect:
    """A link between ranks, as the α-β model sees it."""

    name: str  # preset name or where the figures came from
    bandwidth: float  # BW, bytes/s per direction per rank
    latency: float  # α, seconds per message hop
    per_op: tuple[OpLink, ...] = ()  # measured per-operation constants (loopback profiles); empty: BW and α for all

    def __post_init__(self) -> None:
        if not self.bandwidth > 0 or math.isinf(self.bandwidth):
            raise ValueError(f"link bandwidth must be a finite number > 0 bytes/s, got {self.bandwidth}")
        if not self.latency >= 0 or math.isinf(self.latency):
            raise ValueError(f"link latency must be a finite number >= 0 s, got {self.latency}")
        for o in self.per_op:
            if o.op not in OPS or not o.bandwidth > 0 or not o.latency >= 0:
                raise ValueError(f"per-op link {o} needs an op in {OPS}, bandwidth > 0 and latency >= 0")

    def for_op(self, op: str) -> tuple[float, float]:
        """(BW bytes/s, α s) for `op`: its per-op fit if there is one, else the link's."""
        for o in self.per_op:
            if o.op == op:
                return o.bandwidth, o.latency
        return self.bandwidth, self.latency


# Nominal figures, rounded; what a well-tuned collective library gets, not the signalling rate.
# nvlink: NVLink 4 on H100 SXM, 900 GB/s bidirectional = 450 GB/s per direction per GPU, ~3 us per hop.
# pcie: PCIe 4.0 x16, 32 GB/s raw per direction, ~25 GB/s after protocol overhead, ~10 us through the host bridge.
# 25gbe / 100gbe: line rate / 8, with RDMA-class latencies (TCP adds tens of microseconds more).
PRESETS: dict[str, Interconnect] = {
    "nvlink": Interconnect("nvlink", 450e9, 3e-6),
    "pcie": Interconnect("pcie", 25e9, 10e-6),
    "25gbe": Interconnect("25gbe", 3.125e9, 25e-6),
    "100gbe": Interconnect("100gbe", 12.5e9, 10e-6),
}
INTERCONNECTS = (*PRESETS, "loopback")
DEFAULT_LINK_PROFILE = Path("benchmarks/results/comm_loopback.json")
# gloo on TCP loopback between two one-thread processes on this repository's 2-core Sapphire Rapids-class VM
# (benchmarks/comm_bench.py, 2026-12-03 06:46; benchmarks/NOTES.md "Issue 14"): the joint fit and the per-op fits,
# used when no profile file is at hand
LOOPBACK_DEFAULT = Interconnect(
    "loopback (built-in figures of the 2026-12-03 fit, no profile file)", 2.07e9, 92e-6,
    (OpLink("all_reduce", 1.16e9, 150e-6), OpLink("all_gather", 0.75e9, 275e-6), OpLink("send", 2.69e9, 70e-6)))


def _check_ranks(p: int) -> None:
    if p < 1:
        raise ValueError(f"ranks must be >= 1, got {p}")


def _check_bytes(n: float) -> None:
    if not n >= 0:
        raise ValueError(f"num_bytes must be >= 0, got {n}")


def all_reduce_time(num_bytes: float, ranks: int, link: Interconnect) -> float:
    """Ring all-reduce of a `num_bytes` tensor over `ranks` ranks, seconds: 2·(p-1)/p·n/BW + 2·(p-1)·α.

    Thakur, Rabenseifner and Gropp 2005; 0 for one rank. Raises ValueError for ranks < 1 or num_bytes < 0.
    """
    _check_ranks(ranks)
    _check_bytes(num_bytes)
    bw, lat = link.for_op("all_reduce")
    p = ranks
    return 2 * (p - 1) / p * num_bytes / bw + 2 * (p - 1) * lat


def all_gather_time(total_bytes: float, ranks: int, link: Interconnect) -> float:
    """Ring all-gather whose gathered output is `total_bytes` (each rank contributes total/p), seconds:
    (p-1)/p·n/BW + (p-1)·α (Thakur et al. 2005). Raises ValueError for ranks < 1 or total_bytes < 0."""
    _check_ranks(ranks)
    _check_bytes(total_bytes)
    bw, lat = link.for_op("all_gather")
    p = ranks
    return (p - 1) / p * total_bytes / bw + (p - 1) * lat


def send_time(num_bytes: float, link: Interconnect) -> float:
    """One point-to-point message of `num_bytes`, seconds: n/BW + α. Raises ValueError for num_bytes < 0."""
    _check_bytes(num_bytes)
    bw, lat = link.for_op("send")
    return num_bytes / bw + lat


def all_to_all_time(send_bytes: float, ranks: int, link: Interconnect) -> float:
    """All-to-all in which each rank sends `send_bytes` in all (1/p of it to each rank, itself included), seconds:
    (p-1)/p·n/BW + (p-1)·α, pairwise exchange (Thakur et al. 2005). Raises ValueError for ranks < 1 or bytes < 0."""
    _check_ranks(ranks)
    _check_bytes(send_bytes)
    bw, lat = link.for_op("all_to_all")
    p = ranks
    return (p - 1) / p * send_bytes / bw + (p - 1) * lat


def interconnect(name: str, bandwidth_gbs: float | None = None, latency_us: float | None = None,
                 profile: Path | None = None) -> tuple[Interconnect, str]:
    """The link `name` (a preset or "loopback"), with --link-bandwidth-gbs / --link-latency-us replacing its
    figures; returns it and a note on where the figures came from.

    loopback reads `profile` (benchmarks/comm_bench.py's JSON; default benchmarks/results/comm_loopback.json when it
    exists), else falls back to LOOPBACK_DEFAULT. Given figures replace the per-op fits too.

    Raises:
        ValueError: an unknown --interconnect, a bandwidth <= 0 or latency < 0, or an unreadable --link-profile.
    """
    if name not in INTERCONNECTS:
        raise ValueError(f"--interconnect must be one of {INTERCONNECTS}, got {name!r}")
    if bandwidth_gbs is not None and not bandwidth_gbs > 0:
        raise ValueError(f"--link-bandwidth-gbs must be > 0, got {bandwidth_gbs}")
    if latency_us is not None and not latency_us >= 0:
        raise ValueError(f"--link-latency-us must be >= 0, got {latency_us}")
    if name != "loopback":
        link, note = PRESETS[name], "preset"
    elif profile is not None or DEFAULT_LINK_PROFILE.is_file():
        path = profile if profile is not None else DEFAULT_LINK_PROFILE
        link, note = load_link_profile(path), f"measured, {path}"
    else:
        link, note = LOOPBACK_DEFAULT, f"no {DEFAULT_LINK_PROFILE} and no --link-profile: built-in defaults"
    if bandwidth_gbs is None and latency_us is None:
        return link, note
    return Interconnect(f"{link.name} (figures given)",
                        bandwidth_gbs * 1e9 if bandwidth_gbs is not None else link.bandwidth,
                        latency_us * 1e-6 if latency_us is not None else link.latency), "given on the command line"


def load_link_profile(path: Path) -> Interconnect:
    """The loopback link of a benchmarks/comm_bench.py JSON: its joint fit, with its per-op fits.

    Raises:
        ValueError: --link-profile missing, not JSON, or without a "fit" of bandwidth and latency.
    """
    try:
        doc = json.loads(Path(path).read_text())
        joint = doc["fit"]["joint"]
        per_op = tuple(OpLink(op, f["bandwidth_Bps"], f["latency_s"]) for op, f in doc["fit"].get("per_op", {}).items())
        return Interconnect(f"loopback ({path})", joint["bandwidth_Bps"], joint["latency_s"], per_op)
    except (OSError, KeyError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"--link-profile {str(path)!r} is not a comm_bench.py profile: {e!r}") from e


@dataclass(frozen=True, slots=True)
class CommItem:
    """One kind of message of a step."""

    op: str  # "all_reduce", "all_gather" or "send"
    what: str  # which tensor
    ranks: int  # p, ranks taking part (2 for a send)
    messages: int  # messages of this kind on the step's critical path
    message_bytes: float  # bytes of one message's tensor (all-gather: the gathered output), bytes
    time_s: float  # messages · the time of one message, seconds

    @property
    def bytes(self) -> float:
        """messages · message_bytes, bytes."""
        return self.messages * self.message_bytes


@dataclass(frozen=True, slots=True)
class StepComm:
    """The messages of one step (decode or prefill) on its critical path."""

    items: tuple[CommItem, ...]  # empty without parallelism

    @property
    def bytes(self) -> float:
        """Tensor bytes of every message on the critical path, bytes."""
        return sum(i.bytes for i in self.items)

    @property
    def time_s(self) -> float:
        """Their time, not overlapped with compute or with each other, seconds."""
        return sum(i.time_s for i in self.items)


def _check_layout(tensor_parallel_size: int, pipeline_parallel_size: int, micro_batches: int) -> None:
    for flag, v in (("--tensor-parallel-size", tensor_parallel_size),
                    ("--pipeline-parallel-size", pipeline_parallel_size),
                    ("--pipeline-micro-batches", micro_batches)):
        if v < 1:
            raise ValueError(f"{flag} must be >= 1, got {v}")


def step_comm(arch: ModelArch, tensor_parallel_size: int, pipeline_parallel_size: int, tokens: int,
              sampled_rows: int, activation_bytes: float, link: Interconnect, micro_batches: int = 1) -> StepComm:
    """Messages of a step of `tokens` tokens (`sampled_rows` of them sampled) split into `micro_batches`
    micro-batches on N tensor-parallel ranks times M pipeline stages (GPipe schedule: m + M - 1 slots on the
    critical path, each one micro-batch on the busiest stage; see predict()).

    The embedding all-reduce and the logits all-gather count once (those of the first and the last micro-batch), the
    layers' all-reduces once per slot (⌈L/M⌉ layers of one micro-batch), and the two sends of a stage boundary once
    per hop (m + M - 2 hops).

    Raises:
        ValueError: a size < 1 (named by its flag), tokens < 1, sampled_rows < 0 or activation_bytes <= 0.
    """
    n, m_stages, m = tensor_parallel_size, pipeline_parallel_size, micro_batches
    _check_layout(n, m_stages, m)
    if tokens < 1 or sampled_rows < 0 or not activation_bytes > 0:
        raise ValueError(f"tokens must be >= 1, sampled_rows >= 0 and activation_bytes > 0, got {tokens}, "
                         f"{sampled_rows}, {activation_bytes}")
    per_micro = math.ceil(tokens / m)
    rows_per_micro = math.ceil(sampled_rows / m)
    slots = m + m_stages - 1
    hidden_bytes = per_micro * arch.hidden_size * activation_bytes
    items: list[CommItem] = []
    if n > 1:
        layers = 2 * math.ceil(arch.num_layers / m_stages) * slots
        items.append(CommItem("all_reduce", "o_proj and down_proj outputs", n, layers, hidden_bytes,
                              layers * all_reduce_time(hidden_bytes, n, link)))
        items.append(CommItem("all_reduce", "vocab-parallel embedding rows", n, 1, hidden_bytes,
                              all_reduce_time(hidden_bytes, n, link)))
        if rows_per_micro:
            logits = rows_per_micro * n * math.ceil(arch.vocab_size / n) * activation_bytes
            items.append(CommItem("all_gather", "logits of the sampled rows", n, 1, logits,
                                  all_gather_time(logits, n, link)))
    if m_stages > 1:
        # hidden state and residual per hop: the first micro-batch's M-1 hops down the stages, then the last stage's
        # receive of each of the other m-1
        sends = 2 * (m + m_stages - 2)
        items.append(CommItem("send", "hidden state and residual at a stage boundary", 2, sends, hidden_bytes,
                              sends * send_time(hidden_bytes, link)))
    return StepComm(tuple(items))


def shard_arch(arch: ModelArch, tensor_parallel_size: int) -> ModelArch:
    """The busiest rank's share of `arch` under N-way tensor parallelism, as a ModelArch a Roofline can read.

    loom's split (loom/distributed/tensor_parallel.py): whole KV heads per rank, the first ranks one more when
    H_kv % N != 0, each with its query heads; with fewer KV heads than ranks one replicated KV head per rank and H/N
    query heads. The MLP width (and every expert's), the vocab rows of the embedding and the LM head split in
    ⌈x/N⌉ parts; norms are replicated. N = 1 returns `arch` unchanged.

    Raises:
        ValueError: --tensor-parallel-size < 1, or more ranks than KV heads where the engine's split refuses them
            (ranks not a multiple of the KV heads, or query heads not a multiple of the ranks).
    """
    n = tensor_parallel_size
    _check_layout(n, 1, 1)
    if n == 1:
        return arch
    group = arch.num_heads // arch.num_kv_heads
    if arch.num_kv_heads >= n:
        kv = math.ceil(arch.num_kv_heads / n)
        q = kv * group
    elif n % arch.num_kv_heads or arch.num_heads % n:
        raise ValueError(f"--tensor-parallel-size {n} with {arch.num_kv_heads} KV heads and {arch.num_heads} query "
                         "heads: with fewer KV heads than ranks, the ranks must be a multiple of the KV heads and "
                         "split the query heads evenly")
    else:
        kv, q = 1, arch.num_heads // n

    def split(x: int) -> int:
        return math.ceil(x / n) if x else 0

    return ModelArch(
        name=f"{arch.name} (tensor-parallel shard of {n})", num_layers=arch.num_layers, hidden_size=arch.hidden_size,
        num_heads=q, num_kv_heads=kv, head_dim=arch.head_dim, intermediate_size=split(arch.intermediate_size),
        vocab_size=split(arch.vocab_size), tie_word_embeddings=arch.tie_word_embeddings,
        max_position_embeddings=arch.max_position_embeddings, qk_norm=arch.qk_norm, num_experts=arch.num_experts,
        experts_per_tok=arch.experts_per_tok, moe_intermediate_size=split(arch.moe_intermediate_size),
        shared_expert_intermediate_size=split(arch.shared_expert_intermediate_size),
        num_dense_mlp_layers=arch.num_dense_mlp_layers, sliding_window=arch.sliding_window,
        num_sliding_layers=arch.num_sliding_layers, sandwich_norm=arch.sandwich_norm)


@dataclass(frozen=True, slots=True)
class PhasePrediction:
    """Predicted time of one decode step or one prefill under a parallel layout."""

    compute_s: float  # roofline floors of the busiest rank over the critical path's slots, seconds
    comm: StepComm  # messages on the critical path
    bubble_fraction: float  # share of a stage's slots it idles in the step, (M-1)/(m+M-1)
    micro_batches: int  # m, micro-batches the phase's tokens are split into

    @property
    def time_s(self) -> float:
        """compute + communication, not overlapped, seconds."""
        return self.compute_s + self.comm.time_s


@dataclass(frozen=True, slots=True)
class ParallelPrediction:
    """Step time, TTFT and tokens/s of a model on N x M ranks over a link."""

    tensor_parallel_size: int  # N, ranks splitting every layer
    pipeline_parallel_size: int  # M, stages of consecutive layers
    link: Interconnect  # the link every collective and send crosses
    activation_bytes: float  # a, bytes per activation element on the wire
    shard: ModelArch  # the busiest tensor-parallel rank's share of the model (all layers)
    decode: PhasePrediction  # one decode step of the whole batch; its time is the TPOT
    prefill: PhasePrediction  # the prefill of one prompt; its time is the TTFT floor
    batch: int  # B, sequences decoded together

    @property
    def decode_tok_s(self) -> float:
        """B / TPOT, output tokens/s."""
        return self.batch / self.decode.time_s


def predict(roof: Roofline, batch: int, context: int, prompt_len: int, tensor_parallel_size: int,
            pipeline_parallel_size: int, link: Interconnect, activation_bytes: float,
            micro_batches: int | None = None) -> ParallelPrediction:
    """Roofline of the busiest rank's shard plus the step's communication, not overlapped.

    Compute: the shard's floors (loom.bench.roofline: max of bytes/BW and FLOP/F, weights and KV of ⌈1/N⌉ of the
    heads and widths) times ⌈L/M⌉/L for a stage's layers (the embedding and LM head are counted pro rata with the
    layers rather than on the first and last stage). Decode runs a GPipe schedule (Huang et al. 2019, "GPipe",
    NeurIPS): the batch split into m micro-batches of ⌈B/m⌉ sequences, the step ending when the last leaves the last
    stage, m + M - 1 stage slots on the critical path, each stage idle (M-1)/(m+M-1) of the step. Every micro-batch
    re-reads its stage's weights, so m > 1 without pipeline stages only costs. A decode step gives each sequence one
    token: TPOT = step time, tokens/s = B / TPOT. Prefill is one prompt in one micro-batch (PP cannot shorten one
    prompt's TTFT; it idles (M-1)/M of each stage).

    Communication is assumed not to overlap compute (loom's gloo collectives block the step), and the link to be
    the same for the tensor-parallel group and the stage boundaries.

    Raises:
        ValueError: a size < 1 or a tensor-parallel size the head split refuses (named by its flag), batch or
            prompt_len < 1, context < 0, activation_bytes <= 0.
    """
    n, m_stages = tensor_parallel_size, pipeline_parallel_size
    m = micro_batches if micro_batches is not None else min(m_stages, batch)
    _check_layout(n, m_stages, m)
    if batch < 1 or prompt_len < 1 or context < 0:
        raise ValueError(f"batch and prompt_len must be >= 1 and context >= 0, got {batch}, {prompt_len}, {context}")
    m = min(m, batch)
    if m_stages > roof.arch.num_layers:  # as the engine refuses it (loom/distributed/pipeline_parallel.py)
        raise ValueError(f"--pipeline-parallel-size {m_stages} exceeds the model's {roof.arch.num_layers} layers")
    shard = shard_arch(roof.arch, n)
    shard_roof = Roofline(shard, roof.machine, roof.weight_bytes_per_param, roof.kv_bytes_per_element)
    stage = math.ceil(roof.arch.num_layers / m_stages) / roof.arch.num_layers
    slots = m + m_stages - 1
    decode = PhasePrediction(
        slots * stage * shard_roof.decode_step_floor(math.ceil(batch / m), context),
        step_comm(roof.arch, n, m_stages, batch, batch, activation_bytes, link, m), (m_stages - 1) / slots, m)
    prefill = PhasePrediction(
        m_stages * stage * shard_roof.prefill_floor(prompt_len),
        step_comm(roof.arch, n, m_stages, prompt_len, 1, activation_bytes, link, 1),
        (m_stages - 1) / m_stages, 1)
    return ParallelPrediction(n, m_stages, link, activation_bytes, shard, decode, prefill, batch)
