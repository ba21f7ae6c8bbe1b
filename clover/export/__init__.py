"""Engine export: ONNX graphs of the two contract callables, and engine directories."""
