// The hand-written layer over the generated service descriptor: createClient(baseUrl, options).
import { create, fromJson, type JsonValue, type MessageInitShape } from "@bufbuild/protobuf";
import { ValueSchema } from "@bufbuild/protobuf/wkt";
import type { HttpBody } from "./gen/google/api/httpbody_pb.js";
import { Code, ConnectError, createClient as createConnectClient, type Interceptor } from "@connectrpc/connect";
import { createGrpcTransport, Http2SessionManager } from "@connectrpc/connect-node";

import { jsonReply, requestBody, sseEvents, type JsonObject } from "./agents.js";
import { inBandError, translateError } from "./errors.js";
import { contentParts, inputChunks, type ContentPartInput, type PromptPart } from "./images.js";
import { AnthropicService } from "./gen/tokenwire/v1/anthropic_pb.js";
import {
  GenerateParametersSchema,
  GenerateRequestSchema,
  TextGeneration,
  type GenerateRequest,
  type GenerateResponse,
  type GenerateStreamResponse,
  type InfoResponse,
} from "./gen/tokenwire/v1/generate_pb.js";
import {
  ChatMessageSchema,
  ChatRequestSchema,
  CompletionRequestSchema,
  OpenAIService,
  type ChatRequest,
  type ChatResponse,
  type ChatStreamResponse,
  type CompletionResponse,
  type CompletionStreamResponse,
} from "./gen/tokenwire/v1/openai_pb.js";
import { ResponsesService } from "./gen/tokenwire/v1/responses_pb.js";

/** The model name every tokenwire server accepts for the model it serves. */
export const SERVED_MODEL = "tgi";

/** Options of createClient. */
export interface ClientOptions {
  /** Sent as `authorization: Bearer <apiKey>` on every call, as `--api-key` servers require. */
  apiKey?: string;
  /** Default deadline of every call (streams included), in milliseconds. Unset: no deadline. */
  timeoutMs?: number;
}

/** Options of one call. */
export interface CallOptions {
  /** Deadline of this call in milliseconds; overrides the client's timeoutMs. */
  timeoutMs?: number;
  /** Aborting it cancels the call (the server stops generating); the call throws CancelledError. */
  signal?: AbortSignal;
}

/** A constraint on the output: a JSON schema (type "json") or a regular expression ("regex"). */
export interface GrammarInit {
  type: "json" | "regex" | string;
  value: JsonValue;
}

/**
 * Generation parameters: maxNewTokens, temperature, topK, topP, stop, seed, details, grammar, ...
 * (the proto's snake_case names, TGI's REST spelling, are accepted too). Unset ones take the
 * server's defaults.
 */
export type GenerateParameters = Omit<
  MessageInitShape<typeof GenerateParametersSchema>,
  "$typeName" | "grammar"
> & { grammar?: GrammarInit };

/**
 * One chat message: {role, content} (name and toolCallId optional). `content` is a string or
 * OpenAI's list of parts: `{type: "text", text}`, `{type: "image_url", image_url: {url}}`, or an
 * image ({data: Uint8Array} / {url} / a Uint8Array, sent as an image_url).
 */
export type ChatMessageInit = Omit<MessageInitShape<typeof ChatMessageSchema>, "$typeName" | "content"> & {
  content?: string | ContentPartInput[];
};

/** A generate prompt: a string, or text and image parts in order (vision-language models). */
export type Prompt = string | PromptPart[];

/**
 * Chat parameters (OpenAI's, camelCase): model (default "tgi"), maxTokens, temperature, topP,
 * seed, stop, frequencyPenalty, n, logprobs, topLogprobs, includeUsage, ...
 */
export type ChatParameters = Omit<MessageInitShape<typeof ChatRequestSchema>, "$typeName" | "messages">;

/** Completion parameters: as ChatParameters, plus echo. */
export type CompletionParameters = Omit<
  MessageInitShape<typeof CompletionRequestSchema>,
  "$typeName" | "prompt"
>;

/** The tokenwire client returned by createClient. */
export interface TokenwireClient {
  /**
   * Generates a completion for `inputs` and resolves when it is finished. `inputs` is a string,
   * or text and images in order: `["What is in ", await imageFromFile("cat.png"), "?"]`.
   */
  generate(inputs: Prompt, parameters?: GenerateParameters, options?: CallOptions): Promise<GenerateResponse>;
  /**
   * Streams a completion, one event per generated token; the last event carries
   * `generatedText` (and `details` when asked for). Breaking out of `for await` or aborting
   * `options.signal` cancels the call on the server.
   */
  generateStream(
    inputs: Prompt,
    parameters?: GenerateParameters,
    options?: CallOptions,
  ): AsyncIterable<GenerateStreamResponse>;
  /** A chat completion (tokenwire.v1.OpenAIService/Chat), resolved when finished. */
  chat(messages: ChatMessageInit[], parameters?: ChatParameters, options?: CallOptions): Promise<ChatResponse>;
  /**
   * A streamed chat completion: the first chunk carries the role, later ones
   * `choices[0].delta.content`. Breaking out of `for await` cancels the call on the server.
   */
  chatStream(
    messages: ChatMessageInit[],
    parameters?: ChatParameters,
    options?: CallOptions,
  ): AsyncIterable<ChatStreamResponse>;
  /** A completion of a string prompt, resolved when finished. */
  completion(prompt: string, parameters?: CompletionParameters, options?: CallOptions): Promise<CompletionResponse>;
  /** A streamed completion of a string prompt. */
  completionStream(
    prompt: string,
    parameters?: CompletionParameters,
    options?: CallOptions,
  ): AsyncIterable<CompletionStreamResponse>;
  /**
   * POST /v1/responses (tokenwire.v1.ResponsesService/CreateResponse): `body` is OpenAI's
   * request ({model, input, instructions, tools, text, max_output_tokens, previous_response_id,
   * store, ...}); resolves to the response object.
   */
  responsesCreate(body: JsonObject, options?: CallOptions): Promise<JsonObject>;
  /** The same request streamed: OpenAI's semantic events (response.created, ...). */
  responsesStream(body: JsonObject, options?: CallOptions): AsyncIterable<JsonObject>;
  /** GET /v1/responses/{id}: a stored response (NotFoundError when it is not stored). */
  responsesRetrieve(responseId: string, options?: CallOptions): Promise<JsonObject>;
  /** DELETE /v1/responses/{id}. */
  responsesDelete(responseId: string, options?: CallOptions): Promise<JsonObject>;
  /**
   * POST /v1/messages (tokenwire.v1.AnthropicService/Messages): `body` is Anthropic's request
   * ({model, max_tokens, messages, system, tools, ...}); resolves to the message object.
   */
  messagesCreate(body: JsonObject, options?: CallOptions): Promise<JsonObject>;
  /** The same request streamed: Anthropic's events (message_start, ..., message_stop). */
  messagesStream(body: JsonObject, options?: CallOptions): AsyncIterable<JsonObject>;
  /** POST /v1/messages/count_tokens: {input_tokens}. */
  messagesCountTokens(body: JsonObject, options?: CallOptions): Promise<JsonObject>;
  /** Describes the served model and the server's limits. */
  info(options?: CallOptions): Promise<InfoResponse>;
  /** True when the server can generate; false when it answers UNAVAILABLE (or is unreachable). */
  health(options?: CallOptions): Promise<boolean>;
  /** Closes the HTTP/2 connection; calls in flight fail. */
  close(): void;
}

function buildRequest(inputs: Prompt, parameters: GenerateParameters = {}): GenerateRequest {
  const chunks = typeof inputs === "string" ? undefined : inputChunks(inputs);
  // Field names as generated (camelCase: maxNewTokens); the proto's snake_case names (TGI's REST
  // spelling: max_new_tokens) are accepted too.
  const byName = new Map<string, string>();
  for (const field of GenerateParametersSchema.fields) {
    byName.set(field.localName, field.localName);
    byName.set(field.name, field.localName);
  }
  const rest: Record<string, unknown> = {};
  let grammar: GrammarInit | undefined;
  const unknown: string[] = [];
  for (const [name, value] of Object.entries(parameters)) {
    const localName = byName.get(name);
    if (localName === undefined) unknown.push(name);
    else if (value === undefined || value === null) continue;
    else if (localName === "grammar") grammar = value as GrammarInit;
    else rest[localName] = value;
  }
  if (unknown.length > 0) {
    throw new TypeError(`unknown generation parameter(s): ${unknown.join(", ")}`);
  }
  return create(GenerateRequestSchema, {
    ...(chunks === undefined ? { inputs: inputs as string } : { inputChunks: chunks }),
    parameters: {
      ...rest,
      ...(grammar === undefined
        ? {}
        : { grammar: { type: grammar.type, value: fromJson(ValueSchema, grammar.value) } }),
    },
  });
}

/** The ChatRequest of OpenAI-shaped messages: a content list becomes the typed contentParts. */
function buildChatRequest(messages: ChatMessageInit[], parameters: ChatParameters = {}): ChatRequest {
  const typed = messages.map((message, i) => {
    const { content, ...rest } = message;
    if (content === undefined || typeof content === "string") return { ...rest, content };
    if (!Array.isArray(content)) {
      throw new TypeError(`messages[${i}].content must be a string or an array of content parts`);
    }
    return { ...rest, contentParts: contentParts(content, `messages[${i}].content`) };
  });
  return create(ChatRequestSchema, { model: SERVED_MODEL, ...parameters, messages: typed });
}

/** A streamed call's events with the client's deadline and cancellation, in-band errors raised. */
async function* cancellableStreamWith<T extends { error?: string; errorType?: string }>(
  start: (signal: AbortSignal, headers: Record<string, string>) => AsyncIterable<T>,
  call: CallOptions | undefined,
  defaultTimeoutMs: number | undefined,
): AsyncGenerator<T> {
  // As generateStream: a local controller so that leaving the loop early resets the stream.
  const controller = new AbortController();
  const onAbort = () => controller.abort(call?.signal?.reason);
  call?.signal?.addEventListener("abort", onAbort, { once: true });
  if (call?.signal?.aborted) onAbort();
  const timeoutMs = call?.timeoutMs ?? defaultTimeoutMs;
  const timer =
    timeoutMs === undefined
      ? undefined
      : setTimeout(
          () => controller.abort(new ConnectError("the call's deadline passed", Code.DeadlineExceeded)),
          timeoutMs,
        );
  const headers: Record<string, string> =
    timeoutMs === undefined ? {} : { "grpc-timeout": `${Math.max(1, Math.ceil(timeoutMs))}m` };
  try {
    for await (const event of start(controller.signal, headers)) {
      if (event.error !== undefined) {
        throw inBandError(event.errorType, event.error);
      }
      yield event;
    }
  } catch (error) {
    throw translateError(error);
  } finally {
    clearTimeout(timer);
    call?.signal?.removeEventListener("abort", onAbort);
    controller.abort();
  }
}

/** The events of a Responses / Messages stream, with the deadline and cancellation of
 * cancellableStreamWith (an HttpBody stream carries no in-band error fields: sseEvents raises). */
function agentStream(
  start: (signal: AbortSignal, headers: Record<string, string>) => AsyncIterable<HttpBody>,
  call: CallOptions | undefined,
  defaultTimeoutMs: number | undefined,
): AsyncIterable<JsonObject> {
  return sseEvents(cancellableStreamWith<HttpBody & { error?: string; errorType?: string }>(
    start, call, defaultTimeoutMs));
}

/**
 * Creates a client for the tokenwire server at `baseUrl` ("http://host:port" of the router, or
 * of Envoy's port, which passes gRPC through). Speaks gRPC over HTTP/2 (cleartext for http://,
 * TLS for https://).
 */
export function createClient(baseUrl: string, options: ClientOptions = {}): TokenwireClient {
  const interceptors: Interceptor[] = [];
  if (options.apiKey !== undefined) {
    const header = `Bearer ${options.apiKey}`;
    interceptors.push((next) => async (request) => {
      request.header.set("authorization", header);
      return next(request);
    });
  }
  const sessionManager = new Http2SessionManager(baseUrl);
  const transport = createGrpcTransport({ baseUrl, interceptors, sessionManager });
  const service = createConnectClient(TextGeneration, transport);
  const openai = createConnectClient(OpenAIService, transport);
  const responses = createConnectClient(ResponsesService, transport);
  const anthropic = createConnectClient(AnthropicService, transport);
  const cancellableStream = <T extends { error?: string; errorType?: string }>(
    start: (signal: AbortSignal, headers: Record<string, string>) => AsyncIterable<T>,
    call: CallOptions | undefined,
  ) => cancellableStreamWith(start, call, options.timeoutMs);
  const callOptions = (call: CallOptions = {}) => ({
    timeoutMs: call.timeoutMs ?? options.timeoutMs,
    signal: call.signal,
  });

  return {
    async generate(inputs, parameters, call) {
      const request = buildRequest(inputs, parameters);
      try {
        return await service.generate(request, callOptions(call));
      } catch (error) {
        throw translateError(error);
      }
    },

    async chat(messages, parameters, call) {
      const request = buildChatRequest(messages, parameters);
      try {
        return await openai.chat(request, callOptions(call));
      } catch (error) {
        throw translateError(error);
      }
    },

    chatStream(messages, parameters, call) {
      const request = buildChatRequest(messages, parameters);
      return cancellableStream((signal, headers) => openai.chatStream(request, { signal, headers }), call);
    },

    async completion(prompt, parameters, call) {
      const request = create(CompletionRequestSchema, { model: SERVED_MODEL, ...parameters, prompt });
      try {
        return await openai.completion(request, callOptions(call));
      } catch (error) {
        throw translateError(error);
      }
    },

    completionStream(prompt, parameters, call) {
      const request = create(CompletionRequestSchema, { model: SERVED_MODEL, ...parameters, prompt });
      return cancellableStream((signal, headers) => openai.completionStream(request, { signal, headers }), call);
    },

    async *generateStream(inputs, parameters, call) {
      const request = buildRequest(inputs, parameters);
      // A local controller so that leaving the loop early (return()) resets the HTTP/2 stream.
      // The deadline is ours too: Connect's own timer is not cleared when a stream is abandoned,
      // and would keep the process alive until it fires.
      const controller = new AbortController();
      const onAbort = () => controller.abort(call?.signal?.reason);
      call?.signal?.addEventListener("abort", onAbort, { once: true });
      if (call?.signal?.aborted) onAbort();
      const timeoutMs = call?.timeoutMs ?? options.timeoutMs;
      const timer =
        timeoutMs === undefined
          ? undefined
          : setTimeout(
              () => controller.abort(new ConnectError("the call's deadline passed", Code.DeadlineExceeded)),
              timeoutMs,
            );
      const headers: Record<string, string> =
        timeoutMs === undefined ? {} : { "grpc-timeout": `${Math.max(1, Math.ceil(timeoutMs))}m` };
      try {
        const events = service.generateStream(request, { signal: controller.signal, headers });
        for await (const event of events) {
          if (event.error !== undefined) {
            throw inBandError(event.errorType, event.error);
          }
          yield event;
        }
      } catch (error) {
        throw translateError(error);
      } finally {
        clearTimeout(timer);
        call?.signal?.removeEventListener("abort", onAbort);
        controller.abort();
      }
    },

    async responsesCreate(body, call) {
      try {
        return await jsonReply(responses.createResponse(requestBody(body, false), callOptions(call)));
      } catch (error) {
        throw translateError(error);
      }
    },

    responsesStream(body, call) {
      return agentStream((signal, headers) =>
        responses.createResponse(requestBody(body, true), { signal, headers }), call, options.timeoutMs);
    },

    async responsesRetrieve(responseId, call) {
      try {
        return await jsonReply(responses.getResponse({ responseId }, callOptions(call)));
      } catch (error) {
        throw translateError(error);
      }
    },

    async responsesDelete(responseId, call) {
      try {
        return await jsonReply(responses.deleteResponse({ responseId }, callOptions(call)));
      } catch (error) {
        throw translateError(error);
      }
    },

    async messagesCreate(body, call) {
      try {
        return await jsonReply(anthropic.messages(requestBody(body, false), callOptions(call)));
      } catch (error) {
        throw translateError(error);
      }
    },

    messagesStream(body, call) {
      return agentStream((signal, headers) =>
        anthropic.messages(requestBody(body, true), { signal, headers }), call, options.timeoutMs);
    },

    async messagesCountTokens(body, call) {
      try {
        return await jsonReply(anthropic.countTokens(requestBody(body), callOptions(call)));
      } catch (error) {
        throw translateError(error);
      }
    },

    async info(call) {
      try {
        return await service.info({}, callOptions(call));
      } catch (error) {
        throw translateError(error);
      }
    },

    async health(call) {
      try {
        await service.health({}, callOptions(call));
        return true;
      } catch (error) {
        const translated = translateError(error);
        if (translated.code === "UNAVAILABLE") {
          return false;
        }
        throw translated;
      }
    },

    close() {
      sessionManager.abort();
    },
  };
}
