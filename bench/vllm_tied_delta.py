"""A delta on a tied model's embedding served by vLLM, against a full update of the same weights.

A model whose config ties the output head to the input embedding (`tie_word_embeddings`, as SmolLM2)
stores both tensors; the trainer sends the shared one once (weight_sync/delta.replica_copy). On CPU vLLM
keeps the head's own packed copy, so a reload that leaves `lm_head.weight` out keeps the old head: this
script is how that was found, and checks the fix (the workers' reload feeds the head the embedding,
server/engines/vllm_weights.py `tied_aliases`). It starts one vLLM engine (35-80 s here) on the tiny model
made tied, then:

1. a full update from a directory holding the new weights (both names), twice, and back to the start:
   vLLM's outputs for a seed repeat exactly (the comparison below can fail only on the weights);
2. the same weights as a delta (2000 elements of the embedding; with --model, a share of every tensor):
   tokens and logprobs equal the full update's, bit for bit;
3. a full reload of the delta's own file (no `lm_head.weight` in it): equal again.

    python bench/vllm_tied_delta.py [--dtype float32|bfloat16]
    python bench/vllm_tied_delta.py --model DIR --dtype bfloat16 --fraction 0.02   # e.g. SmolLM2's directory

With --model (a tied model directory, as `maskroll init-model --from smollm2` writes it) the delta moves
`--fraction` of the elements of every floating-point tensor instead (an RL step's kind of delta: every
layer, most elements unchanged).

Prints one line per check and exits 1 if any fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--model", type=Path, help="a tied model directory (default: the tiny model, made tied)")
    p.add_argument("--fraction", type=float, default=0.02, help="with --model: elements moved per tensor")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="vllm-tied-delta-"))
    for key, sub in (
        ("VLLM_CACHE_ROOT", "vllm"),
        ("TORCHINDUCTOR_CACHE_DIR", "inductor"),
        ("VLLM_RPC_BASE_PATH", "rpc"),
    ):
        (root / sub).mkdir()
        os.environ[key] = str(root / sub)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ["MASKROLL_WEIGHTS_SPOOL"] = str(root / "spool")

    import numpy as np
    import torch
    from safetensors.torch import load_file, save_file

    from maskroll.app.model_init import init_model
    from maskroll.proto.tensor_push import digest_of
    from maskroll.server.config import EngineConfig
    from maskroll.server.engines.contract import EngineRequest, SamplingParams, WeightPatch
    from maskroll.server.engines.vllm_engine import VllmEngine

    if args.model is None:
        model = init_model(root / "tied", seed=0)
        config = json.loads((model / "config.json").read_text())
        config["tie_word_embeddings"] = True
        (model / "config.json").write_text(json.dumps(config))
        state = load_file(str(model / "model.safetensors"))
        state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()  # tied: equal, stored twice
        save_file(state, str(model / "model.safetensors"))
    else:
        model = args.model.resolve()
        state = {}
        for f in sorted(model.glob("*.safetensors")):
            state.update(load_file(str(f)))
    engine = VllmEngine(
        model, max_logprobs=5, config=EngineConfig(enforce_eager=True, seed=0, dtype=args.dtype)
    )
    ids = iter(range(10**9))

    async def sample():
        params = SamplingParams(max_tokens=16, logprobs_k=5, seed=7)
        request = EngineRequest(f"tied-{next(ids)}", np.asarray([256, 84, 104, 101], np.int32), params)
        outs = [o async for o in engine.generate(request)]
        return tuple(np.concatenate([getattr(o, f) for o in outs]) for f in ("token_ids", "sampled_logprobs"))

    def same(a, b) -> bool:
        return all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))

    async def run() -> list[tuple[str, bool]]:
        await engine.start()
        try:
            dtype = getattr(torch, engine.settings.dtype)
            before = await sample()
            new = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
            emb = new["model.embed_tokens.weight"]
            g = torch.Generator().manual_seed(0)
            moved = [n for n, t in new.items() if t.is_floating_point() and n != "lm_head.weight"]
            if args.model is None:
                moved = ["model.embed_tokens.weight"]
            patches = []
            for name in moved:
                t = new[name].view(-1)
                k = 2000 if args.model is None else max(1, int(args.fraction * t.numel()))
                idx = torch.randperm(t.numel(), generator=g)[:k].sort().values.to(torch.int32)
                t[idx.long()] = (t[idx.long()].float() * (1 + 0.5 * torch.randn(k, generator=g))).to(dtype)
                patches.append(WeightPatch(name, tuple(new[name].shape), t[idx.long()].clone(), idx))
            new["lm_head.weight"] = emb.clone()
            full_dir = root / "full"
            full_dir.mkdir()
            save_file(new, str(full_dir / "model.safetensors"))
            await engine.update_weights(1, full_dir)
            full = await sample()
            await engine.update_weights(2, full_dir)
            again = await sample()
            await engine.update_weights(3, model)
            back = await sample()
            digests = {
                k: digest_of(v.contiguous().view(-1).view(torch.uint8).numpy()) for k, v in new.items()
            }
            del digests["lm_head.weight"]  # sent once, under the embedding's name
            await engine.apply_weight_patches(4, patches, digests, "the delta")
            delta = await sample()
            await engine.update_weights(5, engine._weights_dir)
            reloaded = await sample()
            return [
                ("the new weights change the output", not same(full, before)),
                ("a full update repeats exactly", same(full, again) and same(back, before)),
                ("the delta serves what the full update serves", same(delta, full)),
                ("a reload of the delta's file (no lm_head in it) too", same(reloaded, full)),
            ]
        finally:
            await engine.close()

    checks = asyncio.run(run())
    for what, ok in checks:
        print(f"{'ok  ' if ok else 'FAIL'} {what}")
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
