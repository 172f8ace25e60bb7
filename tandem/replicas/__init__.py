"""Engine replicas, below both the server and the offline API: each replica is one engine process
(engine_proc.py) driven through its client (engine_client.py) over ZMQ (ipc.py); replica_set.py starts D of them
with their core shares (data parallelism), router.py picks the replica for a request, and offline_pool.py drives
a ReplicaSet for `LLM(..., dp_size=D)`.
"""
