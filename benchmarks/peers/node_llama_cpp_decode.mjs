// Single-stream decode speed and resident memory of llama.cpp (through node-llama-cpp's prebuilt
// CPU binaries) on one GGUF file; the llama.cpp peer of benchmarks/quant_bench.py (issue 21).
//
//   node node_llama_cpp_decode.mjs '{"model": "/path/model.gguf", "prompt": "...", "threads": 1,
//                                    "prompt_tokens": 64, "output_tokens": 64, "runs": 2,
//                                    "node_llama_cpp_dir": "benchmarks/.peers/node-llama-cpp",
//                                    "context_size": 512}'
//
// node-llama-cpp is found under node_llama_cpp_dir (an `npm install --prefix DIR node-llama-cpp@3.22.1`),
// else $NODE_LLAMA_CPP_DIR. Prints one line "RESULT {json}": load_s, rss_after_load and peak_rss
// (bytes; peak = getrusage maxRSS; the KV cache is context_size tokens, default 512, f16), weight_bytes (llama.cpp model.size), single_decode_tok_s (1 / median over runs of the mean time per
// output token after the first, greedy, one sequence), per-token median, llama.cpp release.
import {createRequire} from "node:module";
import {join, resolve} from "node:path";
import {pathToFileURL} from "node:url";

const a = JSON.parse(process.argv[2]);
const dir = resolve(a.node_llama_cpp_dir || process.env.NODE_LLAMA_CPP_DIR || "benchmarks/.peers/node-llama-cpp");
const entry = createRequire(join(dir, "package.json")).resolve("node-llama-cpp");
const {getLlama} = await import(pathToFileURL(entry).href);
const pkg = createRequire(entry)(join(dir, "node_modules", "node-llama-cpp", "package.json"));

const median = (xs) => {
  const s = [...xs].sort((x, y) => x - y);
  const m = s.length >> 1;
  return s.length % 2 ? s[m] : (s[m - 1] + s[m]) / 2;
};
const now = () => Number(process.hrtime.bigint()) / 1e9;

const t0 = now();
// NOTE: build "never": use the prebuilt binaries only (a source build is what this peer avoids).
const llama = await getLlama({gpu: false, build: "never"});
const model = await llama.loadModel({modelPath: a.model});
const ctx = await model.createContext({contextSize: a.context_size || 512, sequences: 1, threads: a.threads});
const loadS = now() - t0;
const rssAfterLoad = process.memoryUsage().rss;
const seq = ctx.getSequence();
const prompt = model.tokenize(a.prompt, false).slice(0, a.prompt_tokens);

async function run(n) {
  await seq.clearHistory();
  const times = [];
  // temperature 0 = greedy (argmax); no repeat penalty, as pagedllm's SamplingParams(temperature=0).
  for await (const _tok of seq.evaluate(prompt, {temperature: 0})) {
    times.push(now());
    if (times.length >= n) break;
  }
  return times;
}

await run(8);  // warm-up
const perRun = [];
const perToken = [];
for (let i = 0; i < a.runs; i++) {
  const t = await run(a.output_tokens);
  perRun.push((t[t.length - 1] - t[0]) / (t.length - 1));
  for (let j = 1; j < t.length; j++) perToken.push(t[j] - t[j - 1]);
}
const rel = llama.llamaCppRelease;
console.log("RESULT " + JSON.stringify({
  version: `node-llama-cpp ${pkg.version} (llama.cpp ${rel.release}, ${llama.buildType})`,
  load_s: loadS, prompt_tokens: prompt.length, threads: a.threads, weight_bytes: model.size,
  single_decode_tok_s: 1 / median(perRun), single_decode_tok_s_per_token_median: 1 / median(perToken),
  batch16_decode_tok_s: null, rss_after_load: rssAfterLoad,
  peak_rss: process.resourceUsage().maxRSS * 1024,
}));
process.exit(0);
