"""Train a (tiny, embedded) HF model with `transformers.Trainer` under the rla backend.

    python examples/train_with_trainer.py

`model.compile(backend="rla")` before building the Trainer is all it takes (accelerate refuses
`torch_compile_backend="rla"`: it accepts only the backend names it knows). The `rla_compile`
logger prints one line per compiled graph (here: its sites, all rewritten).
"""

import logging
import tempfile

import torch
from transformers import Trainer, TrainingArguments

from rla_compile.tiny import tiny_causal_lm

logging.basicConfig(format="%(name)s: %(message)s")
logging.getLogger("rla_compile").setLevel(logging.INFO)  # or TORCH_LOGS=+rla_compile
summaries: list[str] = []  # what the logger printed, kept to check it below


class Keep(logging.Handler):
    def emit(self, record):
        summaries.append(record.getMessage())


logging.getLogger("rla_compile").addHandler(Keep())

model = tiny_causal_lm("qwen3")  # swap in AutoModelForCausalLM.from_pretrained(...) for a real one
generator = torch.Generator().manual_seed(0)
data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 128, (8, 16), generator=generator)]

with tempfile.TemporaryDirectory() as out:
    args = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=4,
        max_steps=4,
        learning_rate=1e-3,
        logging_steps=1,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
    )
    # Compile the model in place (it keeps its class and forward signature, which the Trainer
    # reads). `TrainingArguments(torch_compile_backend="rla")` is refused by accelerate, which
    # accepts only the backend names it knows: docs/training.md.
    # compiler="aot_eager" skips Inductor's codegen to keep this example fast; drop it for real runs.
    model.compile(backend="rla", options={"compiler": "aot_eager"})
    result = Trainer(model=model, args=args, train_dataset=data).train()

print(f"trained {result.global_step} steps, mean loss {result.training_loss:.4f}")
assert torch.isfinite(torch.tensor(result.training_loss))
# the training graph's 13 sites were rewritten (2 layers: 5 norms, 4 residual norms, 2 MLPs, 4 RoPE)
assert any("rewritten residual_rmsnorm=4, rmsnorm=5, rope=4, swiglu=2" in line for line in summaries), summaries
