"""scheduler: pure-Python KV memory managers, iteration-level scheduling, workloads, a roofline
cost model and a simulator. No torch import anywhere in this package."""
