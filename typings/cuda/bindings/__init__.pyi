# Stub for `cuda.bindings` (cuda-bindings ships no type information).
# Only the submodules pb_tensor.cuda imports are declared (runtime.pyi, driver.pyi).
__version__: str
