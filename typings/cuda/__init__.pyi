# Stub for the `cuda` namespace package (cuda-python ships no type information).
# Only what pb_tensor.cuda uses is declared; see bindings/runtime.pyi and bindings/driver.pyi.
