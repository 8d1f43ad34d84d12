"""Weight-only quantization of compiled models: the schemes and their packing (`scheme`,
numpy only) and the kernels that read packed weights (`kernels`, TE). The Relax rewrite that
puts them into a model is `compiler.passes.pack_weights`."""
from .scheme import GROUP_SIZES, SCHEMES, Scheme, dequantize, from_meta, quantize, scheme  # noqa: F401
