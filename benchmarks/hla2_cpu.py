"""Side-by-side CPU timing of second-order HLA: TVM kernels vs PyTorch eager, several shapes.

    python benchmarks/hla2_cpu.py
"""
from hla_tvm.bench.operator import run

if __name__ == "__main__":
    for length in (1024, 8192):
        run(batch=1, heads=8, length=length, head_dim=64)
