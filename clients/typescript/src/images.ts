// Images as prompt parts: a generate prompt given as text and images becomes the request's typed
// `inputChunks`; a chat message's OpenAI-shaped content list becomes its `contentParts`.
import { readFile } from "node:fs/promises";

import type { MessageInitShape } from "@bufbuild/protobuf";

import type { InputChunkSchema } from "./gen/tokenwire/v1/generate_pb.js";
import type { ChatContentPartSchema } from "./gen/tokenwire/v1/openai_pb.js";

/**
 * An image for a vision-language model: its encoded bytes (PNG, JPEG or WebP), or a URL the server
 * reads (`data:image/...;base64,...` or http(s); the server refuses private and loopback addresses
 * unless it allows them).
 */
export type ImageInput = { data: Uint8Array } | { url: string };

/** One part of a generate prompt: text, or an image (an ImageInput, or its bytes). */
export type PromptPart = string | ImageInput | Uint8Array;

/** One part of a chat message's content: OpenAI's text / image_url parts, or an image. */
export type ContentPartInput =
  | { type: "text"; text: string }
  | { type: "image_url"; image_url: { url: string; detail?: string } }
  | ImageInput
  | Uint8Array;

type InputChunkInit = MessageInitShape<typeof InputChunkSchema>;
type ContentPartInit = MessageInitShape<typeof ChatContentPartSchema>;

/** The image in a local file (its bytes are sent; the server never reads your files). */
export async function imageFromFile(path: string): Promise<ImageInput> {
  return { data: new Uint8Array(await readFile(path)) };
}

function describe(value: unknown): string {
  if (value === null) return "null";
  if (Array.isArray(value)) return "an array";
  return typeof value === "object" ? `an object with keys [${Object.keys(value as object).join(", ")}]` : typeof value;
}

/** The image a part names, or undefined when the part is no image. */
function imageOf(part: unknown): ImageInput | undefined {
  if (part instanceof Uint8Array) return { data: part };
  if (typeof part !== "object" || part === null) return undefined;
  const keys = Object.keys(part);
  if (keys.length !== 1) return undefined;
  if (keys[0] === "data" && (part as { data: unknown }).data instanceof Uint8Array) return part as ImageInput;
  if (keys[0] === "url" && typeof (part as { url: unknown }).url === "string") return part as ImageInput;
  return undefined;
}

/** The type an image's bytes declare (the server checks the bytes either way). */
function mediaType(data: Uint8Array): string {
  const starts = (...bytes: number[]) => bytes.every((b, i) => data[i] === b);
  if (starts(0x89, 0x50, 0x4e, 0x47)) return "image/png";
  if (starts(0xff, 0xd8, 0xff)) return "image/jpeg";
  if (starts(0x52, 0x49, 0x46, 0x46) && String.fromCharCode(...data.subarray(8, 12)) === "WEBP") return "image/webp";
  return "application/octet-stream";
}

/** An image as a URL: its own, or its bytes as a `data:` URL (chat's image_url). */
export function imageUrl(image: ImageInput): string {
  if ("url" in image) return image.url;
  return `data:${mediaType(image.data)};base64,${Buffer.from(image.data).toString("base64")}`;
}

/** The typed prompt parts of a generate prompt; TypeError names the first bad part. */
export function inputChunks(inputs: unknown): InputChunkInit[] {
  if (!Array.isArray(inputs)) {
    throw new TypeError(`inputs must be a string or an array of text and image parts, not ${describe(inputs)}`);
  }
  if (inputs.length === 0) throw new TypeError("inputs must not be an empty array");
  return inputs.map((part: unknown, i): InputChunkInit => {
    if (typeof part === "string") return { chunk: { case: "text", value: part } };
    const image = imageOf(part);
    if (image === undefined) {
      throw new TypeError(
        `inputs[${i}] must be a string (text) or an image ({data: Uint8Array}, {url: string} or a ` +
          `Uint8Array), not ${describe(part)}`,
      );
    }
    const source = "url" in image ? { case: "url" as const, value: image.url } : { case: "data" as const, value: image.data };
    return { chunk: { case: "image", value: { source } } };
  });
}

/** A chat message's content list as typed parts; TypeError names the part (`messages[0].content[1]`). */
export function contentParts(content: unknown[], where: string): ContentPartInit[] {
  return content.map((part: unknown, j): ContentPartInit => {
    const at = `${where}[${j}]`;
    if (typeof part === "string") return { part: { case: "text", value: part } };
    const image = imageOf(part);
    if (image !== undefined) return { part: { case: "imageUrl", value: { url: imageUrl(image) } } };
    const kind = typeof part === "object" && part !== null ? (part as { type?: unknown }).type : undefined;
    if (kind === "text") {
      const text = (part as { text?: unknown }).text;
      if (typeof text !== "string") throw new TypeError(`${at}.text must be a string, not ${describe(text)}`);
      return { part: { case: "text", value: text } };
    }
    if (kind === "image_url") {
      const value = (part as { image_url?: unknown }).image_url;
      const url = typeof value === "object" && value !== null ? (value as { url?: unknown }).url : value;
      if (typeof url !== "string") throw new TypeError(`${at}.image_url.url must be a string, not ${describe(url)}`);
      return { part: { case: "imageUrl", value: { url } } };
    }
    throw new TypeError(
      `${at} must be a content part ({type: "text", text} or {type: "image_url", image_url: {url}}) or an ` +
        `image, not ${describe(part)}`,
    );
  });
}
