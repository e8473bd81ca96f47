"""A Python client of Tessera's gRPC API (proxy/edge/grpc_api/tessera.proto).

Start a proxy with the gRPC API on (`tessera up --set proxy:http.grpc_port=50051`, or `grpc_port: 50051` in its
config), then:

    python docs/examples/grpc_client.py --target 127.0.0.1:50051 "Write a haiku about the sea."

It streams one chat completion with Generate, then runs two requests on one GenerateStream call, granting
credits as it reads. With auth_enabled, pass --api-key (sent as `authorization: Bearer ...` metadata).
"""
from __future__ import annotations

import argparse

import grpc

from proxy.edge.grpc_api import tessera_pb2 as pb
from proxy.edge.grpc_api import tessera_pb2_grpc as rpc


def chat(text: str, model: str, max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(model=model, chat=pb.Chat(messages=[pb.ChatMessage(role="user", content=text)]),
                              max_tokens=max_tokens, temperature=0.0)


def generate(stub: rpc.GenerateStub, request: pb.GenerateRequest, metadata=()) -> tuple[str, str]:
    """The whole text of one streamed request and its finish reason."""
    text, finish = [], ""
    for message in stub.Generate(request, metadata=metadata):
        for choice in message.choices:
            text.append(choice.text)
            finish = choice.finish_reason or finish
    return "".join(text), finish


def generate_many(stub: rpc.GenerateStub, requests: dict[str, pb.GenerateRequest], credits: int = 8,
                  metadata=()) -> dict[str, str]:
    """Several requests on one GenerateStream call: the text of each, by id. A credit goes back per message read."""
    import queue
    outgoing: queue.Queue = queue.Queue()
    for i, (request_id, request) in enumerate(requests.items()):
        outgoing.put(pb.StreamRequest(start=pb.StreamRequest.Start(
            id=request_id, request=request, initial_credits=credits if i == 0 else 0)))

    def sending():
        while (message := outgoing.get()) is not None:
            yield message

    texts = {request_id: [] for request_id in requests}
    open_ids = set(requests)
    for reply in stub.GenerateStream(sending(), metadata=metadata):
        outgoing.put(pb.StreamRequest(credit=pb.StreamRequest.Credit(messages=1)))
        kind = reply.WhichOneof("kind")
        if kind == "response":
            texts[reply.id].extend(choice.text for choice in reply.response.choices)
        elif kind == "error":
            raise RuntimeError(f"{reply.id}: {reply.error.status}: {reply.error.message}")
        elif kind == "done":
            open_ids.discard(reply.id)
            if not open_ids:
                outgoing.put(None)  # half-close: the server ends the call
    return {request_id: "".join(parts) for request_id, parts in texts.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt")
    parser.add_argument("--target", default="127.0.0.1:50051")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--api-key")
    args = parser.parse_args()
    metadata = (("authorization", f"Bearer {args.api_key}"),) if args.api_key else ()
    with grpc.insecure_channel(args.target) as channel:
        stub = rpc.GenerateStub(channel)
        text, finish = generate(stub, chat(args.prompt, args.model, args.max_tokens), metadata)
        print(f"{text}\n[finish: {finish}]")
        both = generate_many(stub, {"a": chat(args.prompt, args.model, 16), "b": chat("Say hi.", args.model, 16)},
                             metadata=metadata)
        for request_id, text in both.items():
            print(f"{request_id}: {text}")
        models = rpc.AdminStub(channel).ListModels(pb.ListModelsRequest())
        print("models:", [m["id"] for m in models.models])


if __name__ == "__main__":
    main()
