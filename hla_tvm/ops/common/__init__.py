"""What the operators share: the float64 reference helpers (`reference`), the fast PyTorch
forms' chunking and in-place updates (`fast`), the TensorIR pieces (`tir`), the chain calls
(`calls`) and the kernels' dtypes (`dtypes`)."""
