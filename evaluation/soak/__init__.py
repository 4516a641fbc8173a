"""Faults under load: a soak of the OpenAI endpoints through real HTTP, with chaos, checking that nothing is lost.

``specray soak`` (``jobs.soak``) deploys the Serve app on the cluster built here and hands this harness its URL:

- ``services``: a Ray cluster of several nodes on this machine (:class:`~evaluation.soak.services.SoakCluster`: a
  head that keeps Serve's controller, the proxy, the ingress and the engine replica, and worker nodes for the actor
  entry's placement group plus a spare) and a persistent ``redis-server`` for the registry
  (:class:`~evaluation.soak.services.RedisServer`, append-only file, as ``infra/kuberay/redis.yaml``);
- ``plan``: the load's mix, the plan and the faults (:data:`~evaluation.soak.plan.FAULTS`) at set times;
- ``harness``: the soak itself (:class:`~evaluation.soak.harness.Soak`: the load, on one asyncio loop with
  ``httpx``), ``faults`` its faults and their recovery, ``answers`` how each request ended (ok, a clean error, or a
  violation);
- ``processes``: RSS and open file descriptors of every process of the run, sampled as time series;
- ``analysis`` and ``outputs``: per fault the recovery time, the requests it affected and p99 latency before,
  during and after; over the run the outcomes, the identity checks and every process's growth; the report, the
  plot and the files.
"""
