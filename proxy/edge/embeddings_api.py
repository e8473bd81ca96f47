"""POST /v1/embeddings, in OpenAI's shape.

A request's way through this module:

    API key (401, with auth_enabled) -> read body (413) -> parse (400) -> tenant -> model version
    (``proxy.cluster.served_models``: 404, 503 while none serves it) -> the proxy not draining (503) and the tenant's
    rate limit (429) -> tokenize in a thread (400: an empty input, a token outside the vocabulary, an input longer
    than the context, naming ``input[i]``)
    -> ``proxy.cluster.embeddings.Embeddings.embed``: a prefill-capable worker of that version computes the batch
    -> ``dimensions`` (the first so many, normalized again) -> float lists or base64 -> the body, with usage.

Embeddings take no decode slot and hold no pages, so they bypass the admission queue and its fairness;
``embedding_max_inflight_tokens`` bounds what is in flight instead.
"""
from __future__ import annotations

import asyncio
import base64

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from proxy.edge.auth import tenant_from_body, tenant_from_header
from proxy.core.errors import ApiError
from proxy.edge.openai_api import serving_context
from proxy.cluster.served_models import served_headers, session_of
from proxy.edge.openapi import EmbeddingResponse, error_responses, request_body
from proxy.edge.protocol import EmbeddingRequest, read_model

router = APIRouter()


@router.post("/v1/embeddings", openapi_extra=request_body(EmbeddingRequest), response_model=EmbeddingResponse,
             responses=error_responses(400, 401, 404, 413, 429, 503, 504))
async def embeddings(request: Request) -> Response:
    """Each input's pooled last hidden state: mean over its tokens, normalized, unless the model declares its
    own pooling."""
    services = request.app.state.services
    try:
        body, served = await _embed(request, services)
        status = "200"
        response: Response = JSONResponse(body, headers=served)
    except ApiError as error:
        status, response = str(error.status), error.response()
    services.metrics.requests.labels("embeddings", status).inc()
    return response


async def _embed(request: Request, services) -> tuple[dict, dict[str, str]]:
    tenant = tenant_from_header(services.cluster.tenants, request.headers.get("authorization"))  # None: auth off
    body = await read_model(request, EmbeddingRequest, services.config.http.max_prompt_bytes)
    return await embed(services, body, tenant, request.headers)


async def embed(services, body: EmbeddingRequest, tenant, headers) -> tuple[dict, dict[str, str]]:
    """The response body of a parsed request and its headers; ``tenant``: the API key's, None without auth."""
    tenant = tenant or tenant_from_body(services.cluster.tenants, body.user)
    services.models.check(body.model)
    await services.cluster.joined()
    serving_context(services, tenant)
    choice = services.models.choose(body.model, session_of(services, headers, body.user))
    max_model_len = choice.max_model_len
    inputs = await asyncio.to_thread(body.input_token_ids, choice.tokenizer)
    longest = max(range(len(inputs)), key=lambda i: len(inputs[i]))
    if len(inputs[longest]) > max_model_len:
        raise ApiError(400, f"input[{longest}] has {len(inputs[longest])} tokens; this model's maximum context "
                       f"length is {max_model_len} tokens", code="context_length_exceeded", param="input")
    vectors = await services.cluster.embeddings.embed(inputs, choice.key)
    if body.dimensions is not None:
        vectors = reduce_dimensions(vectors, body.dimensions)
    if body.encoding_format == "base64":
        data = [base64.b64encode(v.astype("<f4").tobytes()).decode() for v in vectors]
    else:
        data = vectors.tolist()
    tokens = sum(map(len, inputs))
    return {"object": "list", "model": body.model,
            "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(data)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}, served_headers(choice)


def reduce_dimensions(vectors: np.ndarray, dimensions: int) -> np.ndarray:
    """The first ``dimensions`` of each vector, at unit length again (as OpenAI shortens its embeddings)."""
    if dimensions > vectors.shape[1]:
        raise ApiError(400, f"dimensions is {dimensions}; this model's embeddings have {vectors.shape[1]}",
                       code="invalid_value", param="dimensions")
    kept = vectors[:, :dimensions]
    norms = np.linalg.norm(kept, axis=1, keepdims=True)
    return kept / np.where(norms > 0, norms, 1)
