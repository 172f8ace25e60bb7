"""Put on a vLLM server's PYTHONPATH by tandem.bench.vllm_peer when TANDEM_ISA=avx2 (an AVX2 machine emulated on
an AVX-512 one): torch's CPU-feature probes answer as an AVX2-only CPU would, so vLLM imports its AVX2 kernel
library (vllm._C_AVX2, not the AVX-512 one) and picks the attention ISA an AVX2 CPU gets. Without this, vLLM's
own kernels (its attention) kept AVX-512 under the emulation while tandem's ran their AVX2 bodies. Python runs
this file at start-up in every process of the server (the engine core too), so the probes are patched before
vLLM reads them."""
import os

if os.environ.get("TANDEM_ISA", "").lower() == "avx2":
    import torch

    for _probe in ("_is_avx512_supported", "_is_avx512_vnni_supported", "_is_avx512_bf16_supported",
                   "_is_amx_tile_supported", "_is_amx_fp16_supported"):
        if hasattr(torch.cpu, _probe):
            setattr(torch.cpu, _probe, lambda: False)
