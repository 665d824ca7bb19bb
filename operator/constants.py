"""Constants the control plane shares with the data plane (API group, version, ports, labels).

The worker and router command lines (issues 3 and 4) listen on these ports under these port
names; the router's Kubernetes discovery finds the pool Services by these labels.
"""

API_GROUP = "serving.splitserve.io"
API_VERSION = "v1alpha1"
KIND = "InferenceService"
PLURAL = "inferenceservices"
SINGULAR = "inferenceservice"
SHORT_NAMES = ("isvc", "ssvc")

# Worker ports: gRPC (Generate / Prefill / KV events), Prometheus + /health + /ready, KV transfer.
GRPC_PORT = 50051
METRICS_PORT = 9090
KV_PORT = 13337
# A multi-node worker's rendezvous: the leader pod (node rank 0) listens here for the other pods'
# ranks (torch.distributed's TCP store; torchrun's default port).
DIST_PORT = 29500
# UCX's TCP transport listens on ports of its own beside KV_PORT (its connection manager's
# port); the workers pin them to this range (UCX_TCP_PORT_RANGE) so the NetworkPolicy can allow them.
UCX_TCP_PORTS = (13340, 13399)
# Router (gateway) ports: the OpenAI API with /health and /ready, and Prometheus metrics.
ROUTER_HTTP_PORT = 8000
ROUTER_METRICS_PORT = 9090
GRPC_PORT_NAME = "grpc"
METRICS_PORT_NAME = "metrics"
KV_PORT_NAME = "kv"
HTTP_PORT_NAME = "http"

ROUTER_CONFIG_DIR = "/etc/splitserve"
ROUTER_CONFIG_FILE = "router.yaml"
# The declared LoRA adapters, a second key of the router's ConfigMap: not hashed into the router's
# pod template, so a change reaches the running router (router/placement/adapter_sync.py) without a new pod.
ROUTER_ADAPTERS_FILE = "adapters.yaml"

# Labels on every child (app.kubernetes.io/* are Kubernetes' recommended labels).
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_ROLE = f"{API_GROUP}/role"
APP_NAME = "splitserve"
MANAGER = "splitserve-operator"
# Set by Kubernetes' EndpointSlice controller on every slice of a Service.
LABEL_SERVICE_NAME = "kubernetes.io/service-name"

# LeaderWorkerSet (leaderworkerset.x-k8s.io/v1) for multi-node workers: the label its controller
# puts on every pod of a group (0 on the leader), and the variables its webhook gives each container.
LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
LWS_KIND = "LeaderWorkerSet"
LABEL_LWS_WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"
LWS_LEADER_ADDRESS_ENV = "LWS_LEADER_ADDRESS"
LWS_WORKER_INDEX_ENV = "LWS_WORKER_INDEX"

ANNOTATION_REPLICAS_OWNER = f"{API_GROUP}/replicas-owner"
ANNOTATION_CONFIG_HASH = f"{API_GROUP}/config-hash"
# Written by the router on its ConfigMap: per pool, the workers and how many hold each adapter (JSON).
ANNOTATION_ADAPTERS_LOADED = f"{API_GROUP}/adapters-loaded"

# The queue-depth metric the workers export (Gateway API Inference Extension name), and the
# name prometheus-adapter gives it for the HPA's Pods metric (':' is not allowed there).
QUEUE_METRIC = "vllm:num_requests_waiting"
QUEUE_METRIC_ADAPTER = "vllm_num_requests_waiting"
FLOW_QUEUE_METRIC = "splitserve_router_flow_queue_length"  # requests held in the routers (router/flow/)

DEFAULT_IMAGE_REPOSITORY = "ghcr.io/splitserve/splitserve"
CUDA_TAG_SUFFIX = "-cuda"
RUN_AS_USER = 10001
# On a pool's pod template: the fingerprint of the certificates the operator issued it
# (operator/credentials.py), so a renewed certificate rolls the pool onto it.
ANNOTATION_TLS_REVISION = f"{API_GROUP}/tls-revision"
