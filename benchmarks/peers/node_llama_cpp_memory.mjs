// Resident memory of llama.cpp (node-llama-cpp's prebuilt CPU binaries) on one GGUF file, the peer of
// benchmarks/memory_lazykv.py (issue 30): RSS after loading with one sequence of `context_size` tokens
// (llama.cpp's default f16 KV cache), then after running the prompts of `prompts_file` one after another
// (JSON list of {"prompt": str, "max_tokens": int}; the history is cleared between them), greedy.
//
//   node node_llama_cpp_memory.mjs '{"model": "/path/model.gguf", "context_size": 8192, "threads": 1,
//                                    "prompts_file": "/tmp/prompts.json", "node_llama_cpp_dir": "DIR"}'
//
// node-llama-cpp comes from `npm install --prefix DIR node-llama-cpp@3.22.1`. Prints one line "RESULT {json}"
// with /proc/self/status VmRSS, RssAnon, RssFile and VmHWM (bytes) at "load" and "after", llama.cpp's
// model.size (weight bytes) and the KV cache state size. Not a timing: the load does not matter.
import {readFileSync} from "node:fs";
import {createRequire} from "node:module";
import {join, resolve} from "node:path";
import {pathToFileURL} from "node:url";

const a = JSON.parse(process.argv[2]);
const dir = resolve(a.node_llama_cpp_dir || process.env.NODE_LLAMA_CPP_DIR || "benchmarks/.peers/node-llama-cpp");
const entry = createRequire(join(dir, "package.json")).resolve("node-llama-cpp");
const {getLlama} = await import(pathToFileURL(entry).href);
const pkg = createRequire(entry)(join(dir, "node_modules", "node-llama-cpp", "package.json"));

function status() {
  const out = {};
  for (const line of readFileSync("/proc/self/status", "utf8").split("\n")) {
    const m = line.match(/^(VmRSS|RssAnon|RssFile|VmHWM):\s+(\d+) kB/);
    if (m) out[m[1]] = Number(m[2]) * 1024;
  }
  return out;
}

const llama = await getLlama({gpu: false, build: "never"});
const model = await llama.loadModel({modelPath: a.model});
const ctx = await model.createContext({contextSize: a.context_size, sequences: 1, threads: a.threads});
const seq = ctx.getSequence();
await new Promise((r) => setTimeout(r, 2000));
const load = status();
const prompts = a.prompts_file ? JSON.parse(readFileSync(a.prompts_file, "utf8")) : [];
let n = 0;
for (const p of prompts) {
  await seq.clearHistory();
  const toks = model.tokenize(p.prompt, false).slice(0, a.context_size - p.max_tokens - 8);
  let k = 0;
  for await (const _t of seq.evaluate(toks, {temperature: 0})) {
    if (++k >= p.max_tokens) break;
  }
  n++;
}
const after = status();
const rel = llama.llamaCppRelease;
console.log("RESULT " + JSON.stringify({
  version: `node-llama-cpp ${pkg.version} (llama.cpp ${rel.release}, ${llama.buildType})`,
  context_size: a.context_size, threads: a.threads, weight_bytes: model.size, requests: n,
  load, after,
}));
process.exit(0);
