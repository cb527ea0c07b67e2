"""Several engine replicas behind one endpoint on Ray Serve, each request sent to the replica that holds
the deepest exact checkpoint of its prompt: `hyserve serve MODEL --replicas N` (needs `hyserve[ray]`).

publish: what a replica tells the router it holds; router: the routing policy (plain code, no Ray);
keys: the ingress's render of a request's prompt tokens; bridge: one HTTP request through the in-process
app; deployment: the Ray Serve deployments and request router; launch: start or join a cluster and serve."""
