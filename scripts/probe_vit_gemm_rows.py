"""Do padded rows change a GEMM's real rows? The ViT tower's linear layers (Qwen2.5-VL 7B vision shapes) at
M real rows against the same rows computed inside a call padded to the graph budget bucket mode would replay.

Bucket mode replays a call of M patches at the smallest captured budget >= M, so its GEMMs run with
more rows than the eager call of graphs off. Row results are the same only where the GEMM library picks a
kernel whose accumulation order over K does not depend on M (no split-K / stream-K difference between the
two shapes). This prints, per layer shape and per range of M, how many M give a bitwise difference and the
largest one. GPU only; no sglang needed.

    python3 scripts/probe_vit_gemm_rows.py [--budgets 512,704,...] [--step 4]
"""
import argparse

import torch

# (name, in features, out features, rows per patch): Qwen2.5-VL 7B vision tower, 3B-shaped text model.
SHAPES = [("patch_embed", 1176, 1280, 1), ("qkv", 1280, 3840, 1), ("proj", 1280, 1280, 1),
          ("gate_up", 1280, 6840, 1), ("down", 3420, 1280, 1), ("merger_fc1", 5120, 5120, 4),
          ("merger_fc2", 5120, 2048, 4)]
# The ladder one fa3 server captured (run 20261203T211111Z-2217's log).
LADDER = "512,704,832,1088,1344,1664,2112,2624,3264,4160,5184,6528,8256"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default=LADDER)
    parser.add_argument("--step", type=int, default=4, help="patches between probed call sizes (a multiple of 4)")
    args = parser.parse_args()
    budgets = sorted(int(b) for b in args.budgets.split(","))
    third = len(budgets) // 3
    edges = [0, budgets[third], budgets[2 * third], budgets[-1] + 1]
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, bf16, padded to the next of {budgets}; "
          f"call sizes every {args.step} patches, those equal to a budget left out")
    print("per layer and range of M (patches): sizes whose real rows differ / sizes probed, largest |diff|; "
          "first for M a multiple of 64, then the others")
    print(f"{'layer':<12} " + "  ".join(f"[{lo},{hi}) x64 | other".ljust(40) for lo, hi in zip(edges, edges[1:])))
    for name, k, n, rows_per in SHAPES:
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        x_all = torch.randn(budgets[-1] // rows_per, k, device="cuda", dtype=torch.bfloat16)
        cells = []
        for lo, hi in zip(edges, edges[1:]):
            sizes = [p for p in range(max(lo, args.step), hi, args.step) if p not in budgets]
            diffs = []
            for patches in sizes:
                budget = next(b for b in budgets if b >= patches)
                m, padded = patches // rows_per, budget // rows_per
                eager = torch.nn.functional.linear(x_all[:m], weight, bias)
                replay = torch.nn.functional.linear(x_all[:padded], weight, bias)[:m]
                diffs.append((eager.float() - replay.float()).abs().max())
            diffs = torch.stack(diffs).tolist() if diffs else []  # one sync per range
            parts = []
            for on_64 in (True, False):
                picked = [d for p, d in zip(sizes, diffs) if (p % 64 == 0) == on_64]
                parts.append(f"{sum(d != 0.0 for d in picked)}/{len(picked)} {max(picked, default=0.0):.1e}")
            cells.append(" | ".join(parts).ljust(40))
        print(f"{name:<12} " + "  ".join(cells))


if __name__ == "__main__":
    main()
