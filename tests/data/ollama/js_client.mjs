// The official `ollama` JS client (npm) against the server: list, show, chat streamed,
// generate with a suffix, streamed and whole. Prints what it read as one JSON object.
// Usage: node js_client.mjs <base url> <prefix> <suffix> <num_predict>
import { Ollama } from 'ollama'

const [host, prefix, suffix, predict] = process.argv.slice(2)
const client = new Ollama({ host })
const options = { temperature: 0, num_predict: Number(predict) }
const listed = await client.list()
const shown = await client.show({ model: 'coder' })
let chat = ''
for await (const part of await client.chat({
  model: 'tiny', messages: [{ role: 'user', content: 'one two one two' }], options, stream: true,
})) chat += part.message.content
let filled = ''
for await (const part of await client.generate({ model: 'coder', prompt: prefix, suffix, options, stream: true }))
  filled += part.response
const whole = await client.generate({ model: 'coder', prompt: prefix, suffix, options, stream: false })
let refused = null
try { await client.generate({ model: 'tiny', prompt: prefix, suffix, stream: false }) }
catch (error) { refused = { status: error.status_code, error: error.error } }
console.log(JSON.stringify({
  names: listed.models.map((m) => m.name), capabilities: shown.capabilities,
  chat, filled, whole: whole.response, refused,
}))
