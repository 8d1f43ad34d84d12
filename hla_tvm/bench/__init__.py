"""What `hla-tvm bench` times, in one process beside the strongest PyTorch forms: `operator` (one
operator's decode step or prefill), `model` (a whole language model per weight scheme, beside
PyTorch, torch.compile, ONNX Runtime and the weight-read floor), `timing` (rounds, settling,
the machine's description)."""
