// llama.cpp (through node-llama-cpp's prebuilt CPU binaries) on one GGUF
// file: prefill of a prompt and greedy decode, timed; prints one JSON line.
//   node bench.mjs <model.gguf> <threads> <prompt_tokens> <decode_steps> <runs>
import {getLlama} from "node-llama-cpp";

const [path, threads, promptLen, steps, runs] = process.argv.slice(2);
const llama = await getLlama({gpu: false, build: "never", logLevel: "error"});
const model = await llama.loadModel({modelPath: path, gpuLayers: 0, useMmap: true});
const n = Number(promptLen);
const context = await model.createContext({
  threads: Number(threads),
  contextSize: n + Number(steps) + 16,
  batchSize: Math.max(n, 1),
  sequences: 1,
});
// A prompt of exactly n tokens: the text repeated, cut to n.
let ids = model.tokenize("The history of the city begins with a small settlement by the river. ");
while (ids.length < n) ids = ids.concat(ids);
ids = ids.slice(0, n);
const out = {backend: llama.gpu || "cpu", build: llama.buildType, cpu: llama.cpuMathCores,
             threads: Number(threads), prompt_tokens: n, steps: Number(steps),
             prefill_s: [], decode_s: [], tokens: []};
for (let r = 0; r < Number(runs); ++r) {
  const seq = context.getSequence();
  const t0 = performance.now();
  let t1 = 0, got = [];
  for await (const token of seq.evaluate(ids, {temperature: 0})) {
    if (got.length === 0) t1 = performance.now();
    got.push(token);
    if (got.length > Number(steps)) break;
  }
  const t2 = performance.now();
  out.prefill_s.push((t1 - t0) / 1000);
  out.decode_s.push((t2 - t1) / 1000 / Number(steps));
  out.tokens = got.slice(0, Number(steps) + 1);
  seq.dispose();
}
console.log(JSON.stringify(out));
await context.dispose();
await model.dispose();
