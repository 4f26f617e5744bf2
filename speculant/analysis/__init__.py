"""Simulators, acceptance estimates, the latency twin and depth-predictor training (closed forms: `speculant.theory`;
profiles: `speculant.latency`). The simulators need neither torch nor a model; `acceptance`, `depth` and `online`
run the real decoders."""
