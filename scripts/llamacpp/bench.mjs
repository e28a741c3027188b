// llama.cpp (through node-llama-cpp's prebuilt CPU binaries) on one GGUF
// file: prefill of a prompt and greedy decode, timed; prints one JSON line.
//   node bench.mjs <model.gguf> <threads> <prompt_tokens> <decode_steps> <runs> [batch]
// With batch > 1, `batch` sequences of one context (prompt i starts i
// tokens further into the text) run at once: node-llama-cpp decodes their
// tokens together, one llama_decode a step. prefill_s: until every row
// has its first token; decode_s: a step of the whole batch.
import {getLlama} from "node-llama-cpp";

const [path, threads, promptLen, steps, runs, batchArg] = process.argv.slice(2);
const batch = Number(batchArg || 1);
const llama = await getLlama({gpu: false, build: "never", logLevel: "error"});
const model = await llama.loadModel({modelPath: path, gpuLayers: 0, useMmap: true});
const n = Number(promptLen);
const context = await model.createContext({
  threads: Number(threads),
  contextSize: batch * (n + Number(steps) + 16),
  batchSize: Math.max(n * batch, 1),
  sequences: batch,
});
// Prompts of exactly n tokens: the text repeated, row i cut from token i.
let ids = model.tokenize("The history of the city begins with a small settlement by the river. ");
while (ids.length < n + batch) ids = ids.concat(ids);
const prompts = Array.from({length: batch}, (_, i) => ids.slice(i, i + n));
const out = {backend: llama.gpu || "cpu", build: llama.buildType, cpu: llama.cpuMathCores,
             threads: Number(threads), prompt_tokens: n, steps: Number(steps), batch,
             prefill_s: [], decode_s: [], tokens: []};
// One sequence a row, kept for every run (their K/V cleared between).
const seqs = prompts.map(() => context.getSequence());
for (let r = 0; r < Number(runs); ++r) {
  const firsts = [], ends = [], got = prompts.map(() => []);
  const t0 = performance.now();
  await Promise.all(seqs.map(async (seq, i) => {
    for await (const token of seq.evaluate(prompts[i], {temperature: 0})) {
      if (got[i].length === 0) firsts[i] = performance.now();
      got[i].push(token);
      if (got[i].length > Number(steps)) break;
    }
    ends[i] = performance.now();
  }));
  const first = Math.max(...firsts), end = Math.max(...ends);
  out.prefill_s.push((first - t0) / 1000);
  out.decode_s.push((end - first) / 1000 / Number(steps));
  out.tokens = got[0].slice(0, Number(steps) + 1);
  for (const seq of seqs) await seq.clearHistory();
}
for (const seq of seqs) seq.dispose();
console.log(JSON.stringify(out));
await context.dispose();
await model.dispose();
