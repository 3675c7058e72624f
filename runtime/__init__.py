"""runtime: KV caches on real memory (vmem and paged layouts), attention backends, model
integration, the engine and the ``vmemkv`` CLI."""
