// A sudden spike to 5x the base rate and back: nothing fails, latency recovers.
import http from 'k6/http';
import { check } from 'k6';
import { BACKSTOP, RATE, chat, headers, latency } from './lib.js';

const stage = __ENV.STAGE || '10s';

export const options = {
  scenarios: {
    spike: {
      executor: 'ramping-arrival-rate',
      startRate: RATE, timeUnit: '1s', preAllocatedVUs: 100, maxVUs: 1000,
      stages: [
        { target: RATE, duration: stage },
        { target: RATE * 5, duration: '1s' },
        { target: RATE * 5, duration: stage },
        { target: RATE, duration: '1s' },
        { target: RATE, duration: stage },
      ],
    },
  },
  thresholds: Object.assign({
    http_req_failed: ['rate<0.001'],
    checks: ['rate>0.999'],
  }, latency({ http_req_duration: ['p(99)<100'] })),
};

export default function () {
  const res = http.post(`${BACKSTOP}/v1/chat/completions`, chat(), { headers: headers() });
  check(res, { 'status 200': (r) => r.status === 200 });
}
