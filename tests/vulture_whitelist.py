"""Names vulture cannot see used (tests/unit/test_dead_code.py reads this file, it is never imported).

Each is used from outside the Python call graph; anything else vulture reports is dead code to delete.
"""
# ruff: noqa

# Registered by name: entry-point commands, FastAPI routes and exception handlers, pydantic config.
add_bench_command  # unused function (bench/loadgen/command.py:27)
add_sim_worker_command  # unused function (bench/sim/command.py:23)
_.request_tag  # unused attribute (common/runtime/telemetry.py:60)
add_decode_command  # unused function (decode_worker/command.py:14)
add_both_command  # unused function (decode_worker/command.py:20)
add_command  # unused function (prefill_worker/command.py:14)
tokenize  # unused function (proxy/app.py:105)
detokenize  # unused function (proxy/app.py:113)
healthz  # unused function (proxy/app.py:122)
session_turns  # unused function (proxy/app.py: the GET /v1/sessions/{id} route, called by FastAPI)
readyz  # unused function (proxy/app.py:126)
version_  # unused function (proxy/app.py:133)
_api_error  # unused function (proxy/core/errors.py:76)
_request_validation  # unused function (proxy/core/errors.py:80)
_http_error  # unused function (proxy/core/errors.py:84)
_unexpected  # unused function (proxy/core/errors.py:88)
add_command  # unused function (proxy/main.py:20)
completions  # unused function (proxy/edge/openai_api.py:58)
chat_completions  # unused function (proxy/edge/openai_api.py:66)
resume_stream  # unused function (proxy/edge/takeover.py: a route)
stream_socket  # unused function (proxy/edge/websocket_api.py: a WebSocket route)
_subnormal_is_zero  # unused method (proxy/edge/protocol.py: a pydantic field validator)
model_config  # unused variable (proxy/edge/protocol.py:39)
model_config  # unused variable (proxy/edge/protocol.py:147)
model_config  # unused variable (proxy/edge/protocol.py:153)
model_config  # unused variable (proxy/edge/protocol.py:217)
model_config  # unused variable (proxy/edge/protocol.py:232)
add_tenants_command  # unused function (proxy/tenants_command.py: an entry point)

# Called by libraries: http.server, uvicorn, prometheus_client collectors, ZeroMQ's ZAP, Jinja extensions, NIXL and ZeroMQ socket options.
_.daemon_threads  # unused attribute (common/runtime/health_server.py:48)
protocol_version  # unused variable (common/runtime/health_server.py:89)
_.do_GET  # unused method (common/runtime/health_server.py:91)
_.log_message  # unused method (common/runtime/health_server.py:99)
media_type  # Starlette's Response.init_headers reads it (proxy/edge/openai_api.py EventStreamResponse)
background  # FastAPI reads it of every response (proxy/edge/openai_api.py EventStreamResponse)
_.describe  # unused method (common/runtime/telemetry.py:138)
_.curve_secretkey  # unused attribute (common/runtime/zmq_security.py:131)
_.curve_publickey  # unused attribute (common/runtime/zmq_security.py:132)
_.curve_server  # unused attribute (common/runtime/zmq_security.py:133)
_.curve_secretkey  # unused attribute (common/runtime/zmq_security.py:138)
_.curve_publickey  # unused attribute (common/runtime/zmq_security.py:139)
_.curve_serverkey  # unused attribute (common/runtime/zmq_security.py:140)
_.callback  # unused method (common/runtime/zmq_security.py:150)
domain  # unused variable (common/runtime/zmq_security.py:150)
_.model_max_length  # unused attribute (common/storage/gguf_convert.py:54)
tags  # unused variable (common/text/tokenizer.py:147)
_.parse  # unused method (common/text/tokenizer.py:149)
_._render  # unused method (common/text/tokenizer.py:154)
_.useProgThread  # unused attribute (kv_transfer/nixl_backend.py:84)
_.useListenThread  # unused attribute (kv_transfer/nixl_backend.py:85)
_.syncMode  # unused attribute (kv_transfer/nixl_backend.py:86)
_.pthrDelay  # unused attribute (kv_transfer/nixl_backend.py:87)
_.handle_exit  # unused method (proxy/server.py:50)
_.should_exit  # unused attribute (proxy/server.py:54)
_.should_exit  # unused attribute (proxy/server.py:77)

# Public API read by tests, benchmarks or results files.
expected_output_len  # unused variable (bench/loadgen/records.py:34)
_.stop_worker  # unused method (common/cli/local_cluster.py:162)
post_json  # unused function (common/cli/local_cluster.py:186)
missing_docs  # unused function (common/config/docs.py:78)
_.num_blocks_in_use  # unused property (common/engine/draft_proposer.py:60)
_.has_work  # unused method (common/engine/scheduler.py:104)
pulls_done  # unused variable (kv_transfer/base.py:142)
pulls_failed  # unused variable (kv_transfer/base.py:143)
bytes_pulled  # unused variable (kv_transfer/base.py:144)
pull_seconds  # unused variable (kv_transfer/base.py:145)
_.pulls_done  # unused attribute (kv_transfer/base.py:289)
_.bytes_pulled  # unused attribute (kv_transfer/base.py:290)
_.pull_seconds  # unused attribute (kv_transfer/base.py:291)
_.pulls_failed  # unused attribute (kv_transfer/base.py:293)
prompt_tokens_details  # unused variable (proxy/edge/openapi.py:37)
cached_prompt_tokens  # unused variable (proxy/core/metrics.py: TenantUsage, written to the metering file by asdict)
embedding  # unused variable (proxy/edge/openapi.py: Embedding, a response field in the OpenAPI document)
# gRPC servicer methods (proxy/edge/grpc_api/service.py): grpc calls them by the .proto's method names.
_.Generate
_.GenerateStream
_.Embed
_.Tokenize
_.Detokenize
_.ListModels
_.Health
