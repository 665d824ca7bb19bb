"""Settings written once and rendered everywhere they are needed (torch-free).

`worker_args.WorkerArgs` holds every `splitserve worker` flag; the worker's CLI, `splitserve up`,
the operator's pod renderer and the Ray replica all fill it in."""
