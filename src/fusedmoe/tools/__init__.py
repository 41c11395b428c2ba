"""Tools around the library: the command line (``fusedmoe info | bench | tune | demo``), the benchmarks, the
config tuner, the demo and the model-shape presets they share. The core (``fusedmoe`` outside ``tools`` and
``integrations``) imports none of them."""
