"""Measure the train/inference mismatch on the shipped model and see which site moves it.

Small sizes so it runs in about a minute on a laptop CPU; `rla-compile mismatch --ablation`
runs the full measurement. The inference side is vLLM when installed, else HF with eager
kernels (the report's note says which).
"""

from rla_compile import mismatch

report = mismatch.measure(
    trainer="hf-aot_eager:train",  # the trainer's forward with eager kernels: fast to compile
    inference="hf-inductor",        # an inference stack with different (fused) kernels
    rows=[("rla off", None, None), ("rope only, both sides", ("rope",), ("rope",)),
          ("rla on both", tuple(mismatch.DEFAULT_SITES), tuple(mismatch.DEFAULT_SITES))],
    prompts=2, prompt_tokens=16, new_tokens=16, say=print,
)
print(report.table())
assert report.row("rla off").metrics.tokens == 32
# aligning the sites changes what the two stacks disagree on (the same tokens, other logprobs)
assert report.row("rla on both").delta != report.row("rla off").delta
# both sides aligned every site of the shipped model's 4 layers (RoPE on q and k in each)
assert report.sites["hf-aot_eager+rla:train"] == report.sites["hf-inductor+rla"]
assert report.sites["hf-inductor+rla"]["rope"] == 8 and report.sites["hf-inductor+rla[rope]"] == {"rope": 8}
