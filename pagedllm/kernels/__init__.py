"""Native CPU kernels (C++ via torch.utils.cpp_extension), see ``cpu_ops``."""
