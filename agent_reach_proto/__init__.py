"""Agent-Reach's wire contracts, shared by the agent SDK and Reach itself.

- `wire`: the agent wire contract's names on every protocol (headers, metadata keys, frame keys,
  MQTT user properties) and the small helpers both ends share; its prose is docs/protocols/.
  Standard library only, as every agent loads it.
- `agent_pb2`: `reach.agent.v1.Agent`, the service a gRPC agent implements (generated).
- `gateway_pb2`: `reach.v1.Reach`, the gateway's gRPC front on port 7601 (generated).

`make proto` regenerates the `_pb2` modules.

Services are bound with grpcio's generic handlers (see `connectors.grpc`, `gateway_api.grpc_front`
and `agent_reach_sdk.servers.grpc`), so no untyped `_pb2_grpc` stubs are generated.
"""
