// llama.cpp's next-token distributions (through node-llama-cpp's prebuilt
// CPU binaries) along given token sequences, teacher-forced: after each
// prefix of each row, the probability of every token of the vocabulary
// (llama.cpp's softmax: temperature 1, no top-k, top-p or min-p cut).
//   node probs.mjs <model.gguf> <threads> <rows.json> <out.f32> <vocab>
// rows.json: [[token ids of a row], ...]; out.f32: float32, one row of
// vocabulary size per position i of each row (predicting row[i + 1]),
// the rows one after another. Prints {"vocab": n, "positions": m}.
import fs from "node:fs";
import {getLlama} from "node-llama-cpp";

const [path, threads, rowsFile, outFile, vocabSize] = process.argv.slice(2);
const n = Number(vocabSize);
const rows = JSON.parse(fs.readFileSync(rowsFile, "utf8"));
const llama = await getLlama({gpu: false, build: "never", logLevel: "error"});
const model = await llama.loadModel({modelPath: path, gpuLayers: 0, useMmap: true});
const context = await model.createContext({
  threads: Number(threads),
  contextSize: Math.max(...rows.map((r) => r.length)) + 16,
  sequences: 1,
});
const sampling = {temperature: 1, topK: 0, topP: 1, minP: 0, seed: 0, yieldEogToken: true};
const out = fs.openSync(outFile, "w");
let positions = 0;
for (const ids of rows) {
  const seq = context.getSequence();
  const it = seq.evaluateWithMetadata([ids[0]], {probabilities: true}, sampling);
  for (let i = 1; i < ids.length; ++i) {
    const step = i === 1 ? await it.next() : await it.next(ids[i - 1]);
    if (step.done) throw new Error(`row ended early at position ${i}`);
    const probs = step.value.probabilities;
    if (probs.size !== n) throw new Error(`${probs.size} probabilities, vocabulary ${n}`);
    const row = new Float32Array(n);
    for (const [token, p] of probs) {
      if (!(token >= 0 && token < n)) throw new Error(`token ${token} outside the vocabulary`);
      row[token] = p;
    }
    fs.writeSync(out, row);
    positions += 1;
  }
  await it.return();
  seq.dispose();
}
fs.closeSync(out);
console.log(JSON.stringify({vocab: n, positions}));
await context.dispose();
await model.dispose();
