"""Policy backends: token ids in, token ids and logprobs out (transformers on CPU/GPU, vLLM)."""
