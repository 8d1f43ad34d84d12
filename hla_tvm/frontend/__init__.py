"""Importers that map HLA operators in exported models onto the TensorIR kernels."""
