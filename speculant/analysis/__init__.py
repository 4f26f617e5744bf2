"""Theory, simulators and profiles. Modules here need neither torch nor a model unless they say so."""
