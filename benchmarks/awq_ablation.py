"""AWQ ablation in memory (issue 12, "why AWQ loses to RTN on Qwen"): quantize a model's decoder linears with RTN or
with AWQ variants, then score it against its own float32 logits on held-out prose (Pride and Prejudice windows of
512 tokens): perplexity change, top-1 agreement, mean KL, and the perplexity change split by how unlikely the
reference found each token.

    python benchmarks/awq_ablation.py rtn
    python benchmarks/awq_ablation.py awq --scaling both --no-clip     (--clip auto: loom's default)
    python benchmarks/awq_ablation.py awq --skip-first 1 --normalized-loss --clip-tokens 4096
    (--model FILE: default the Qwen2.5-Coder-0.5B GGUF that loom.bench.model_fetch.fetch_gguf puts in
    $LOOM_MODEL_DIR or ~/.cache/loom/qwen, shared/DESIGN.md; --windows 16 for the report's protocol)

Variants beyond loom's AWQSettings (experiments only, not loom options):
  --skip-first N     leave each calibration window's first N positions out of mean |x| and the search's error
                     (the first token carries Qwen's massive activations)
  --normalized-loss  the search's block error divided per output channel by the float output's RMS (so the
                     residual stream's few huge channels do not dominate it): loom's AWQSettings.loss "normalized"
  --clip-tokens N    tokens the clipping search reads (loom: 512, evenly spaced, as AutoAWQ)
  --clip-window-starts  add every window's first token to the clipping search's tokens
Same calibration as `loom quantize --method awq` (quantize.calibration_for: ShareGPT + Emma, 8 x 512).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import loom.quant.awq_model as am
from loom.bench.heldout import janeausten_text
from loom.bench.model_fetch import model_dir
from loom.bench.quality import compare, token_windows, window_logits
from loom.model.loader import load_model
from loom.quant.awq import fake_quantize, normalized_loss, search_clip, search_scales
from loom.quant.quantize import calibration_windows

QWEN = model_dir() / "qwen2.5-coder-0.5b-instruct.gguf"


def _keep(lengths: list[int], skip: int) -> torch.Tensor:
    """Rows of windows stacked in order, minus each window's first `skip` positions."""
    return torch.cat([torch.arange(n) >= skip for n in lengths])


def _scale_layer(args: argparse.Namespace):
    """awq_model.scale_layer with the --skip-first variant (and --normalized-loss with it)."""

    def scale_layer(layer, arch, windows, feats, settings, name, report):
        attn, mlp = layer.self_attn, layer.mlp
        n = settings.search_windows
        lengths = [f.shape[0] for f in feats["qkv"]]
        keep_all, keep_s = _keep(lengths, args.skip_first), _keep(lengths[:n], args.skip_first)
        xs = {k: torch.cat(v) for k, v in feats.items()}
        search = {k: torch.cat(v[:n]) for k, v in feats.items()}

        def normalized(block):
            return normalized_loss(block) if args.normalized_loss else block

        def attn_block(ws):
            with am._SwapWeight(attn.qkv_proj, ws[0]):
                outs = [attn(x, cs, c, m) for x, (cs, c, m) in zip(feats["qkv"][:n], windows.items[:n])]
                return torch.cat(outs)[keep_s]

        def mlp_block(ws):
            with am._SwapWeight(mlp.gate_up_proj, ws[0]):
                return mlp(search["gate_up"])[keep_s]

        def linear_block(key):
            return lambda ws: search[key][keep_s] @ ws[0].T

        groups = [("qkv", attn.qkv_proj, normalized(attn_block), lambda s: am.fold_qkv(layer, s))]
        if arch.kv_size == arch.q_size:
            groups.append(("o", attn.o_proj, normalized(linear_block("o")), lambda s: am.fold_o(layer, arch, s)))
        groups += [("gate_up", mlp.gate_up_proj, normalized(mlp_block), lambda s: am.fold_gate_up(layer, s)),
                   ("down", mlp.down_proj, normalized(linear_block("down")), lambda s: am.fold_down(layer, arch, s))]
        with torch.no_grad():
            for key, lin, block, fold in groups:
                s, alpha, duo, _ = search_scales(xs[key][keep_all].abs().mean(0), [lin.weight.data.float()], block,
                                                 settings.group_size, settings.grid_points, settings.scaling)
                fold(s)
                xs[key], search[key] = xs[key] / s, search[key] / s
                report.alphas[f"{name}.{key}"], report.duo[f"{name}.{key}"] = alpha, duo
        return {k: v[keep_all] for k, v in xs.items()}

    return scale_layer


def _search_layer_clip(args: argparse.Namespace, window_len: int):
    """awq_model.search_layer_clip with --clip-tokens and --clip-window-starts."""

    def search_layer_clip(layer, arch, xs, group_size):
        bounds = {}
        with torch.no_grad():
            for key, lin in am._linears(layer).items():
                x = xs[key]
                idx = torch.linspace(0, x.shape[0] - 1, min(args.clip_tokens, x.shape[0])).long()
                if args.clip_window_starts:
                    idx = torch.unique(torch.cat([idx, torch.arange(0, x.shape[0], window_len)]))
                bounds[key] = search_clip(lin.weight.data[am._clip_rows(key, arch)], x[idx], group_size)
        return bounds

    return search_layer_clip


def main() -> None:
    class Fmt(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
        pass

    p = argparse.ArgumentParser(description=__doc__, formatter_class=Fmt)
    p.add_argument("method", choices=("rtn", "awq"))
    p.add_argument("--model", default=str(QWEN), help="GGUF file or HF directory")
    p.add_argument("--windows", type=int, default=4, help="held-out windows of 512 tokens")
    p.add_argument("--scaling", choices=("activation", "duo", "both"), default="both", help="AWQSettings.scaling")
    p.add_argument("--clip", choices=am.CLIPS, default="on",
                   help="AWQSettings.clip (default on, as every row measured before auto existed)")
    p.add_argument("--no-clip", dest="clip", action="store_const", const="off", help="--clip off")
    p.add_argument("--search-windows", type=int, default=2, help="AWQSettings.search_windows")
    p.add_argument("--skip-first", type=int, default=0, help="see above")
    p.add_argument("--normalized-loss", action="store_true", help="see above")
    p.add_argument("--clip-tokens", type=int, default=am.CLIP_TOKENS, help="see above")
    p.add_argument("--clip-window-starts", action="store_true", help="see above")
    args = p.parse_args()
    if not Path(args.model).exists():
        p.error(f"--model: no such file or directory: {args.model}" + (
            " (fetch it with: python -c \"from loom.bench.model_fetch import fetch_gguf; "
            "fetch_gguf('qwen2.5-coder-0.5b-instruct')\")" if args.model == str(QWEN) else ""))

    torch.manual_seed(0)
    m = load_model(args.model, torch.float32, torch.device("cpu"), quantization="none")
    held = token_windows(list(m.tokenizer.encode(janeausten_text("prideprejudice"), add_special_tokens=False)),
                         args.windows, 512)
    ref = [window_logits(m.model, m.arch, w) for w in held]
    start = time.perf_counter()
    if args.method == "rtn":  # AWQ's grid at alpha 0 without clipping: asymmetric 4-bit g128, float16 scales
        for layer in m.model.model.layers:
            for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
                lin.weight.data.copy_(fake_quantize(lin.weight.data, 128))
    else:
        calib, _ = calibration_windows(m.tokenizer, None, 8, 512)
        if args.skip_first:  # loom's own scale_layer otherwise (its loss "normalized" is --normalized-loss)
            am.scale_layer = _scale_layer(args)
        am.search_layer_clip = _search_layer_clip(args, 512)
        settings = am.AWQSettings(clip=args.clip, search_windows=args.search_windows, scaling=args.scaling,
                                  loss="normalized" if args.normalized_loss else "mse")
        _, report = am.quantize_model_awq(m.model, m.arch, settings, calib)
        nonzero = sum(a > 0 for a in report.alphas.values())
        scores = {name: f"NLL {s.nll:.4f} KL {s.kl:.4f}" for name, s in report.clip_scores.items()}
        print(f"alpha > 0 in {nonzero} of {len(report.alphas)} groups; duo formula won in {sum(report.duo.values())}; "
              f"clipped: {'+'.join(report.clipped) or 'none'} {scores or ''}")
    print(f"quantized in {time.perf_counter() - start:.0f} s")
    out = [window_logits(m.model, m.arch, w) for w in held]
    r = compare(ref, out, held)
    print(f"{args.method} {vars(args)}: perplexity {r['perplexity_ref']:.3f} -> {r['perplexity']:.3f} "
          f"({r['perplexity_change_pct']:+.2f}%), top-1 {100 * r['top1_agreement']:.2f}%, KL {r['mean_kl']:.4f}")
    nll_ref, nll = [], []
    for a, b, w in zip(ref, out, held, strict=True):
        t = torch.tensor(w[1:])[:, None]
        nll_ref.append(-F.log_softmax(a[:-1].double(), -1).gather(1, t).squeeze(1))
        nll.append(-F.log_softmax(b[:-1].double(), -1).gather(1, t).squeeze(1))
    base, diff = torch.cat(nll_ref), torch.cat(nll) - torch.cat(nll_ref)
    for lo, hi in ((0, 0.5), (0.5, 2), (2, 5), (5, 10), (10, math.inf)):
        sel = (base >= lo) & (base < hi)
        print(f"  reference NLL in [{lo}, {hi}): {int(sel.sum())} tokens, "
              f"mean NLL change {float(diff[sel].mean()):+.3f}")


if __name__ == "__main__":
    main()
