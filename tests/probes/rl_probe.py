"""Run in a fresh process by test_rl.py: the GRPO example (examples/grpo_trl.py) as written,
then what it left behind, as JSON on the last line of stdout: TRL's logs, rla's reports on
both sides, and whether vLLM holds the trained weights.

    python rl_probe.py [example arguments...]
"""

import json
import runpy
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo_trl.py"
sys.argv = [str(EXAMPLE), *sys.argv[1:]]
scope = runpy.run_path(str(EXAMPLE), run_name="__main__")

import rla_compile.integrations.vllm as rla_vllm  # noqa: E402
from rla_compile import bundled  # noqa: E402
from rla_compile.integrations.trl import RlaCallback  # noqa: E402

trainer = scope["trainer"]
callbacks = [c for c in trainer.callback_handler.callbacks if isinstance(c, RlaCallback)]
trainer_reports = [r for c in callbacks if c.backend for r in c.backend.reports]
vllm_reports = [r for p in rla_vllm.injected for r in p.reports]

# TRL syncs before each generation, so the engine holds the weights of one step ago; sync now
# (TRL's sync_weights, replaced on vLLM-CPU). vLLM's embedding is not repacked on CPU: it must
# then equal the trainer's, which differs from the checkpoint's.
trainer.vllm_generation.sync_weights()
llm = trainer.vllm_generation.llm
engine_embed = llm.llm_engine.model_executor.driver_worker.model_runner.model.model.embed_tokens.weight
trained_embed = trainer.model.model.embed_tokens.weight
initial_embed = load_file(bundled.MODEL_DIR / "model.safetensors")["model.embed_tokens.weight"]

print(json.dumps({
    "logs": trainer.state.log_history,
    "trainer_reports": [{"graph": r.graph, "counts": r.counts(), "statuses": sorted({s.status for s in r.sites})}
                        for r in trainer_reports],
    "vllm_reports": [{"graph": r.graph, "counts": r.counts(), "statuses": sorted({s.status for s in r.sites})}
                     for r in vllm_reports],
    "embed_synced": bool(torch.equal(engine_embed.detach().cpu(), trained_embed.detach().cpu())),
    "embed_trained": not bool(torch.equal(trained_embed.detach().cpu(), initial_embed)),
}))
