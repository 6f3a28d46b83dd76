"""Generated protobuf messages of Agent-Reach's gRPC contracts (`make proto` regenerates them).

- `agent_pb2`: `reach.agent.v1.Agent`, the service a gRPC agent implements.
- `gateway_pb2`: `reach.v1.Reach`, the gateway's gRPC front on port 7601.

Services are bound with grpcio's generic handlers (see `connectors.grpc`, `gateway_api.grpc_front`
and `agent_reach_sdk.servers.grpc`), so no untyped `_pb2_grpc` stubs are generated.
"""
